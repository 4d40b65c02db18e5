"""Corrupted bytes in a checkpoint tensor are an error naming the file and the tensor; nothing is trained on.
Zeroed data, a flipped exponent bit, a flipped lowest mantissa bit. One process, real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.checkpoint import consolidate
from zinf.errors import CheckpointError


def _engine() -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _corrupt(file: Path, needle: bytes, how: str) -> None:
    data = bytearray(file.read_bytes())
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the tensor's bytes must appear once in the file"
    if how == "zeroed":
        data[at : at + len(needle)] = bytes(len(needle))
    elif how == "exponent":
        data[at + 4 * 5 + 3] ^= 0x40
    else:
        data[at + 4 * 5] ^= 0x01
    file.write_bytes(data)
    os.sync()


@pytest.mark.parametrize("how", ["zeroed", "exponent", "low_bit"])
def test_a_corrupted_checkpoint_tensor_is_refused_and_nothing_is_loaded(tmp_path: Path, how: str) -> None:
    engine = _engine()
    engine.backward(engine(torch.randn(8, 32)).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    master = engine.master_of(engine.groups[1]).detach().cpu().contiguous()
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(files) == 1
    _corrupt(files[0], master.numpy().tobytes(), how)
    fresh = _engine()
    with pytest.raises(CheckpointError) as err:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
    msg = str(err.value)
    assert f"{files[0]} is corrupted: tensor master.00001 ({master.numel() * 4} bytes, torch.float32) fails its " \
           "checksum" in msg, msg
    # the state streams in group by group: a load that failed part way leaves an engine that refuses to train
    with pytest.raises(CheckpointError, match="partly replaced"):
        fresh(torch.randn(8, 32))
    with pytest.raises(CheckpointError, match="is corrupted: tensor master"):
        consolidate(tmp_path / "ckpt")
    engine.close()
    fresh.close()


def test_an_intact_checkpoint_loads(tmp_path: Path) -> None:
    engine = _engine()
    engine.save_checkpoint(str(tmp_path / "ckpt"), {"epoch": 2})
    fresh = _engine()
    assert fresh.load_checkpoint(str(tmp_path / "ckpt")) == {"epoch": 2}
    assert set(consolidate(tmp_path / "ckpt")) == set(engine.full_state_dict())


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(data)


def test_a_changed_record_or_header_is_refused(tmp_path: Path) -> None:
    """The step, hyper-parameters and layout (the pickled record ``zinf.meta``) and the safetensors header are
    covered by checksums too: a flipped byte in either is refused before anything is loaded."""
    import json
    import struct

    engine = _engine()
    engine.backward(engine(torch.randn(8, 32)).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    (file,) = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    good = file.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    start, _ = json.loads(good[8 : 8 + length])["zinf.meta"]["data_offsets"]
    _flip(file, 8 + length + start + 40)  # inside the pickled record
    with pytest.raises(CheckpointError, match="is corrupted: tensor zinf.meta"):
        _engine().load_checkpoint(str(tmp_path / "ckpt"))
    file.write_bytes(good)
    _flip(file, 8 + good[8:].index(b'"F32"') + 2)  # inside the header: F32 -> F22, still JSON
    with pytest.raises(CheckpointError, match="header does not match its checksum|not safetensors JSON|malformed"):
        _engine().load_checkpoint(str(tmp_path / "ckpt"))
    file.write_bytes(good)
    assert _engine().load_checkpoint(str(tmp_path / "ckpt")) == {}
    engine.close()


def test_a_header_whose_byte_ranges_do_not_hold_its_tensors_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The header is read before its checksum can be: a byte range that does not hold the tensor it describes (the
    checksums' own among them) is an error naming the file, never a torch error from slicing it."""
    import json
    import struct

    from zinf.checkpoint.part_file import PartReader

    engine = _engine()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    (file,) = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    good = file.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + length])
    for name, change in (("zinf.checksums", (0, -3)), ("zinf.checksums", (5, 0)), ("zinf.meta", (0, 1))):
        bad = json.loads(json.dumps(header))
        a, b = bad[name]["data_offsets"]
        bad[name]["data_offsets"] = [a + change[0], b + change[1]]
        text = json.dumps(bad, separators=(",", ":")).encode().ljust(length)  # the same length: the data stays put
        assert len(text) == length
        file.write_bytes(good[:8] + text + good[8 + length :])
        with pytest.raises(CheckpointError, match=str(file)):
            PartReader(file, "zinf-sharded-v3").close()

