"""Corrupted bytes in an offloaded record are an error naming the file, the record and its offset, never
numbers trained on: zeroed data, a flipped exponent bit, a flipped lowest mantissa bit. One process, real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zinf import native
from zinf.offload import OffloadFileError
from test_failures import _engine, _step  # the same one-process NVMe engine and step

pytestmark = pytest.mark.skipif(native.checksum_backend() == "python", reason="checksums need the native build")


def _zero(data: bytearray) -> None:
    data[:] = bytes(len(data))


def _flip_exponent(data: bytearray) -> None:
    data[len(data) // 2 // 4 * 4 + 3] ^= 0x40  # a float32's highest exponent bit: the value becomes huge or tiny


def _flip_low_bit(data: bytearray) -> None:
    data[len(data) // 2 // 4 * 4] ^= 0x01  # the lowest mantissa bit: a change of one part in 2**23


@pytest.mark.parametrize("corrupt", [_zero, _flip_exponent, _flip_low_bit], ids=["zeroed", "exponent", "low_bit"])
@pytest.mark.parametrize("which", ["parameter", "optimizer_state"])
def test_a_corrupted_record_is_refused_with_its_file_record_and_offset(tmp_path: Path, corrupt, which: str) -> None:
    engine = _engine(tmp_path)
    _step(engine)
    swap = engine.placement.swap
    # record 0 is a parameter shard (read by the next forward); records written twice by now are parameter
    # shards and optimizer states, read before they are written again (a gradient record is written first)
    rec = swap.records[0] if which == "parameter" else [r for r in swap.records if r.generation > 1][-1]
    with open(rec.path, "r+b") as f:
        f.seek(rec.offset)
        data = bytearray(f.read(rec.nbytes))
        corrupt(data)
        f.seek(rec.offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(OffloadFileError) as err:
        _step(engine)
    msg = str(err.value)
    assert f"{rec.path} record {rec.record_id} at offset {rec.offset} ({rec.nbytes} bytes) is corrupted" in msg, msg
    assert "CRC32C" in msg and "restart from the last checkpoint" in msg


def test_checksums_cost_is_reported(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    _step(engine)
    _step(engine)
    assert engine.report().counts.get("checksum", 0) > 0
    engine.close()
