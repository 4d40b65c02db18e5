"""AsyncIO round trips and error cases on disk (O_DIRECT) and tmpfs (buffered fallback)."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zinf import native

HAVE_NATIVE = native.info().available
SHM = Path("/dev/shm")


def _backends() -> list[str]:
    out = ["python"]
    if HAVE_NATIVE:
        out.append("threads")
        if native.require().aio.uring_available():
            out.append("io_uring")
    return out


def _make(backend: str, **kw: object) -> native.AsyncIO | native.PythonAsyncIO:
    if backend == "python":
        return native.PythonAsyncIO(**kw)  # type: ignore[arg-type]
    return native.AsyncIO(backend=backend, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=_backends())
def aio(request: pytest.FixtureRequest) -> Iterator[native.AsyncIO | native.PythonAsyncIO]:
    with _make(request.param, block_size=64 * 1024, queue_depth=8, num_threads=2) as engine:
        yield engine


@pytest.fixture(params=["disk", "tmpfs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "disk":
        yield tmp_path
        return
    if not SHM.is_dir():
        pytest.skip("/dev/shm not available")
    d = SHM / f"zinf-test-{os.getpid()}-{threading.get_ident()}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def _aligned(nbytes: int) -> torch.Tensor:
    """A 4096-aligned uint8 tensor of nbytes (so O_DIRECT can be used for its body)."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start : start + nbytes]


def _rand(nbytes: int, seed: int) -> torch.Tensor:
    t = _aligned(nbytes)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (1 << 20) + 3, 3 << 20])
@pytest.mark.parametrize("offset", [0, 4096, 13])
def test_round_trip(aio: native.AsyncIO, where: Path, nbytes: int, offset: int) -> None:
    src = _rand(nbytes, nbytes + offset)
    path = where / "f.bin"
    assert aio.wait(aio.submit_write(src, path, offset)) == nbytes
    assert path.stat().st_size == offset + nbytes
    dst = _aligned(nbytes).zero_()
    assert aio.wait(aio.submit_read(dst, path, offset)) == nbytes
    assert torch.equal(src, dst)


def _mount(tmp_path: Path, fstype: str, opts: list[str]) -> Path:
    mnt = tmp_path / f"mnt-{fstype}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", fstype, *opts, fstype, str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype} (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    return mnt


def test_direct_on_disk(tmp_path: Path) -> None:
    if not HAVE_NATIVE:
        pytest.skip("zinf._native not built")
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs not in ("ext2/ext3", "ext4", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {fs}; O_DIRECT support unknown")
    with native.AsyncIO(block_size=1 << 16) as aio:
        aio.wait(aio.submit_write(_rand(1 << 16, 0), tmp_path / "a.bin"))
        assert aio.direct is True
        aio.wait(aio.submit_write(_rand(100, 0), tmp_path / "b.bin"))  # too small for O_DIRECT
        assert aio.direct is False


def test_buffered_fallback_without_o_direct(tmp_path: Path) -> None:
    """ramfs refuses O_DIRECT with EINVAL (tmpfs accepts it since Linux 6.6): fall back, report it."""
    if not HAVE_NATIVE:
        pytest.skip("zinf._native not built")
    mnt = _mount(tmp_path, "ramfs", [])
    try:
        with native.AsyncIO(block_size=1 << 16) as aio:
            t = _rand((1 << 18) + 5, 0)
            aio.wait(aio.submit_write(t, mnt / "r.bin"))
            assert aio.direct is False
            back = _aligned(t.numel())
            aio.wait(aio.submit_read(back, mnt / "r.bin"))
            assert torch.equal(back, t)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_many_in_flight_and_typed_tensors(aio: native.AsyncIO, where: Path) -> None:
    n_req, elems = 64, 3001  # odd float32 size: 12004 bytes, not a multiple of 4096
    path = where / "many.bin"
    srcs = [torch.randn(elems, generator=torch.Generator().manual_seed(i)) for i in range(n_req)]
    stride = 12288
    handles = [aio.submit_write(s, path, i * stride) for i, s in enumerate(srcs)]
    assert [aio.wait(h) for h in handles] == [elems * 4] * n_req
    dsts = [torch.empty(elems) for _ in range(n_req)]
    handles = [aio.submit_read(d, path, i * stride) for i, d in enumerate(dsts)]
    aio.wait_all()
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_several_python_threads(aio: native.AsyncIO, where: Path) -> None:
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(8):
                src = _rand(50_000 + k * 7 + j, k * 100 + j)
                path = where / f"t{k}_{j}.bin"
                aio.wait(aio.submit_write(src, path, 4096 * j))
                dst = torch.empty_like(src)
                aio.wait(aio.submit_read(dst, path, 4096 * j))
                assert torch.equal(src, dst)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_missing_directory(aio: native.AsyncIO, tmp_path: Path) -> None:
    path = tmp_path / "no" / "such" / "dir" / "x.bin"
    with pytest.raises(native.AIOMissingPathError) as ei:
        aio.wait(aio.submit_write(_rand(8192, 0), path, 4096))
    e = ei.value
    assert e.errno == 2 and e.path == str(path) and e.offset == 4096
    assert str(path) in str(e) and "offset=4096" in str(e)
    assert isinstance(e, OSError) and isinstance(e, native.AIOError)


def test_read_missing_file(aio: native.AsyncIO, tmp_path: Path) -> None:
    with pytest.raises(native.AIOMissingPathError):
        aio.wait(aio.submit_read(_aligned(100), tmp_path / "absent.bin"))


@pytest.mark.parametrize("nbytes,offset", [(100_000, 0), (8192, 45056), (5000, 49_000)])
def test_short_read_and_past_end(aio: native.AsyncIO, where: Path, nbytes: int, offset: int) -> None:
    path = where / "short.bin"
    aio.wait(aio.submit_write(_rand(50_000, 1), path))
    # a request that runs over the end of the file: the error names where the data ran out
    with pytest.raises(native.AIOShortReadError) as ei:
        aio.wait(aio.submit_read(_aligned(nbytes), path, offset))
    assert ei.value.path == str(path) and ei.value.errno == 5
    assert 50_000 <= ei.value.offset < offset + nbytes
    assert "short read" in str(ei.value) and str(path) in str(ei.value)
    # a request that starts past the end
    with pytest.raises(native.AIOShortReadError) as ei2:
        aio.wait(aio.submit_read(_aligned(nbytes), path, 60_000 + offset))
    assert ei2.value.offset >= 60_000 + offset


def test_wait_all_raises_and_unknown_handle(aio: native.AsyncIO, tmp_path: Path) -> None:
    ok = aio.submit_write(_rand(1000, 2), tmp_path / "ok.bin")
    aio.submit_read(_aligned(10), tmp_path / "missing.bin")
    with pytest.raises(native.AIOMissingPathError):
        aio.wait_all()
    with pytest.raises(ValueError):
        aio.wait(ok)
    assert (tmp_path / "ok.bin").stat().st_size == 1000


def test_done_polls_without_consuming_the_handle(aio: native.AsyncIO, tmp_path: Path) -> None:
    data = _rand(1 << 20, 3)
    handle = aio.submit_write(data, tmp_path / "polled.bin")
    while not aio.done(handle):  # never blocks; turns True once the write has finished
        pass
    assert aio.done(handle)  # asking again is allowed: the handle is still to be waited
    assert aio.wait(handle) == 1 << 20
    with pytest.raises(ValueError):
        aio.done(handle)  # waited: unknown now
    back = _aligned(1 << 20)
    aio.wait(aio.submit_read(back, tmp_path / "polled.bin"))
    assert torch.equal(back, data)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = _mount(tmp_path, "tmpfs", ["-o", "size=1m"])
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_no_space_unlinks_file(aio: native.AsyncIO, tiny_tmpfs: Path) -> None:
    path = tiny_tmpfs / "big.bin"
    with pytest.raises(native.AIONoSpaceError) as ei:
        aio.wait(aio.submit_write(_rand(4 << 20, 3), path))
    assert ei.value.errno == 28 and ei.value.path == str(path)
    assert ei.value.unlinked
    assert not path.exists(), "a failed write must not leave a file behind"


def test_require_and_error_types() -> None:
    assert issubclass(native.AIOShortReadError, native.AIOError)
    assert issubclass(native.AIOError, OSError)
    if HAVE_NATIVE:
        assert native.require() is not None


def test_invalid_settings() -> None:
    if not HAVE_NATIVE:
        pytest.skip("zinf._native not built")
    with pytest.raises(ValueError, match="block_size"):
        native.AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="contiguous"):
        with native.AsyncIO() as aio:
            aio.submit_write(torch.zeros(10, 10).t(), "/tmp/x")


@pytest.mark.parametrize("backend", [b for b in _backends() if b != "python"])
def test_a_capped_engine_moves_no_more_than_its_rate(backend: str, tmp_path: Path) -> None:
    """``bytes_per_s`` (``offload.aio_bytes_per_s``): reads and writes together complete no faster than the cap, and
    the bytes are the same as uncapped."""
    import time

    data = _rand(1 << 20, 5)
    back = _aligned(1 << 20)
    rate = 8e6
    with native.AsyncIO(backend=backend, block_size=64 * 1024, bytes_per_s=rate) as aio:
        assert aio.bytes_per_s == rate
        start = time.perf_counter()
        aio.wait(aio.submit_write(data, tmp_path / "capped"))
        aio.wait(aio.submit_read(back, tmp_path / "capped"))
        took = time.perf_counter() - start
    assert took >= 2 * data.numel() / rate * 0.99  # the limit is a lower bound on time, whatever the machine
    assert torch.equal(back, data)
    for bad in (-1.0, 1e-6, float("nan")):  # a rate under a byte a second would wait past any clock
        with pytest.raises(ValueError, match="bytes_per_s"):
            native.AsyncIO(backend=backend, bytes_per_s=bad)
