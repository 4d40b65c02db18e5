"""zinf/offload/in_place.py: a shard laid out from extents of several files at any offsets, read with direct I/O
through block-aligned reads moved into place ([Note: reading extents directly]), equals the bytes put together by
hand, gaps zeroed; a change to a file is caught by its identity, or by the checksum when the identity is restored."""

from __future__ import annotations

import os
import random

import pytest

from zinf import native
from zinf.offload.in_place import CheckpointChangedError, Extent, InPlaceRecord, aligned_empty


def _readers() -> list:
    out = [native.PythonAsyncIO()]
    try:
        out.append(native.AsyncIO())
    except ImportError:
        pass
    return out


@pytest.fixture()
def files(tmp_path) -> dict[str, bytes]:
    rng = random.Random(0)
    out = {}
    for i, size in enumerate((3 * 4096 + 123, 70_001, 9)):
        path = str(tmp_path / f"f{i}.safetensors")
        data = rng.randbytes(size)
        with open(path, "wb") as f:
            f.write(data)
        out[path] = data
    return out


def _case(files: dict[str, bytes], rng: random.Random) -> tuple[int, list[Extent], bytearray]:
    """Random extents in shard order with random gaps; the expected shard."""
    extents, expect, at = [], bytearray(), 0
    for _ in range(rng.randint(1, 6)):
        gap = rng.choice([0, 0, rng.randint(1, 9000)])
        expect += bytes(gap)
        at += gap
        path = rng.choice(list(files))
        data = files[path]
        n = rng.randint(1, min(len(data), 20_000))
        offset = rng.randint(0, len(data) - n)
        extents.append(Extent(path, offset, n, at))
        expect += data[offset : offset + n]
        at += n
    tail = rng.choice([0, rng.randint(1, 5000)])
    return at + tail, extents, expect + bytes(tail)


@pytest.mark.parametrize("reader", range(len(_readers())), ids=lambda i: type(_readers()[i]).__name__)
def test_extents_land_where_the_shard_has_them(files, reader: int) -> None:
    aio = _readers()[reader]
    rng = random.Random(1)
    for case in range(60):
        nbytes, extents, expect = _case(files, rng)
        rec = InPlaceRecord.of("g", nbytes, extents)
        buf = aligned_empty(rec.span)
        buf.fill_(0xAB)  # anything left unwritten shows
        rec.read_with(aio, buf)
        assert bytes(rec.shard_of(buf).numpy().tobytes()) == bytes(expect), (case, extents)
        assert rec.span <= max(4096, nbytes) + 2 * 4096 * len(rec.extents) + 4096
        rec.seal(buf)
        rec.check(buf)
    aio.close()


@pytest.mark.parametrize("reader", range(len(_readers())), ids=lambda i: type(_readers()[i]).__name__)
def test_a_shard_of_one_extent_is_used_where_it_lands(files, reader: int) -> None:
    """One tensor's slice, 16-byte aligned in its file: read as the blocks that cover it and not moved (``start``),
    its padding zeroed after it; a slice at an odd offset is moved into place as before."""
    aio = _readers()[reader]
    path, data = next((p, d) for p, d in files.items() if len(d) > 20_000)
    for offset, n, pad, kept in ((4096 + 48, 9000, 0, True), (160, 7000, 3000, True), (4096 + 7, 9000, 16, False)):
        rec = InPlaceRecord.of("g", n + pad, [Extent(path, offset, n, 0)])
        assert (rec.start == offset % 4096) if kept else rec.start == 0, (offset, rec.start)
        buf = aligned_empty(rec.span)
        buf.fill_(0xAB)
        rec.read_with(aio, buf)
        assert bytes(rec.shard_of(buf).numpy().tobytes()) == data[offset : offset + n] + bytes(pad)
        rec.seal(buf)
        rec.check(buf)
    aio.close()


def test_a_changed_file_is_refused(files) -> None:
    path, data = next(iter(files.items()))
    rec = InPlaceRecord.of("layers.0", 100, [Extent(path, 5000, 100, 0)])
    buf = aligned_empty(rec.span)
    aio = _readers()[-1]
    rec.read_with(aio, buf)
    rec.seal(buf)
    seen = os.stat(path)
    with open(path, "r+b") as f:  # same size, one byte changed, the modification time put back
        f.seek(5050)
        f.write(bytes([data[5050] ^ 1]))
    os.utime(path, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    rec.read_with(aio, buf)
    if native.checksum_backend() != "python":
        with pytest.raises(CheckpointChangedError, match="CRC32C"):
            rec.check(buf)
    os.truncate(path, 4000)
    with pytest.raises(CheckpointChangedError, match="ends before|resized"):
        rec.read_with(aio, buf)
        rec.check(buf)
    os.remove(path)
    with pytest.raises(CheckpointChangedError, match="gone"):
        rec.read_with(aio, buf)
    aio.close()
