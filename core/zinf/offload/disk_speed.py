"""The drives' speed as ``zinf info --nvme PATH`` measures it (:func:`measure_path`, also the planner's
measurement), kept beside the swap files, for the step report.

``zinf info --nvme PATH`` writes ``PATH/zinf-disk-speed.json`` (sequential O_DIRECT write, read, and reads and
writes at once, GB/s, through zinf's AsyncIO with the offload settings). An engine whose ``offload.nvme_paths`` all
have one reports, per step, ``nvme_floor``: the seconds the step's NVMe bytes take at those speeds, beside the waits it
measured, so a run can say how close it is to the disk. The offload engine reads and writes at once, so the floor is
the longest of the reads at the read speed, the writes at the write speed and all bytes at the mixed speed (a drive
may serve both together faster than either alone, or slower); a file measured before the mixed speed was (no
``mixed_gbs``) gives reads and writes one after the other. The rank's files are striped over its paths, so their
speeds add up. Without a measurement for every path there is no floor. A measurement taken under a cap
(``--bytes-per-s``) is kept beside the uncapped one and serves only engines with the same ``offload.aio_bytes_per_s``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["DiskSpeed", "SPEED_FILE", "load_speed", "measure_path", "measure_read", "measured_bytes", "save_speed"]

SPEED_FILE = "zinf-disk-speed.json"
_GB = 1e9


@dataclass(frozen=True)
class DiskSpeed:
    read_bytes_per_s: float
    write_bytes_per_s: float
    mixed_bytes_per_s: float = 0.0  # reads and writes at once, together; 0: not measured

    def floor_s(self, read_bytes: int, written_bytes: int) -> float:
        """Seconds ``read_bytes`` and ``written_bytes`` take at these speeds, moved at once where the mixed speed
        was measured, else one after the other."""
        reads, writes = read_bytes / self.read_bytes_per_s, written_bytes / self.write_bytes_per_s
        if self.mixed_bytes_per_s <= 0:
            return reads + writes
        return max(reads, writes, (read_bytes + written_bytes) / self.mixed_bytes_per_s)


def save_speed(path: str, write_gbs: float, read_gbs: float, direct: bool, mixed_gbs: float = 0.0,
               bytes_per_s: float = 0.0) -> None:
    """Keep a measurement of ``path``; one taken under a cap (``bytes_per_s``, the ``offload.aio_bytes_per_s`` it ran
    with) is kept beside the uncapped one, for engines with that cap only."""
    speeds = _speeds(path)
    speeds[_cap_key(bytes_per_s)] = {"write_gbs": write_gbs, "read_gbs": read_gbs, "mixed_gbs": mixed_gbs,
                                     "direct": direct}
    with open(os.path.join(path, SPEED_FILE), "w") as f:
        json.dump({"speeds": speeds}, f)


def _cap_key(bytes_per_s: float) -> str:
    return str(int(bytes_per_s))


def _speeds(path: str) -> dict[str, dict]:
    """The measurements kept at ``path`` by cap ("0": none); a file of the older form is the uncapped one."""
    try:
        with open(os.path.join(path, SPEED_FILE)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    if isinstance(found.get("speeds"), dict):
        return {k: v for k, v in found["speeds"].items() if isinstance(v, dict)}
    return {"0": found}


def load_speed(paths: Sequence[str], bytes_per_s: float = 0.0) -> DiskSpeed | None:
    """The summed speed of ``paths`` measured under the cap ``bytes_per_s`` (0: uncapped), or None when one of them
    was never measured so (or not with O_DIRECT)."""
    read = write = mixed = 0.0
    every_mixed = True
    for path in paths:
        found = _speeds(path).get(_cap_key(bytes_per_s))
        if not found or not found.get("direct") or found.get("read_gbs", 0) <= 0 or found.get("write_gbs", 0) <= 0:
            return None
        read, write = read + found["read_gbs"] * 1e9, write + found["write_gbs"] * 1e9
        mixed += found.get("mixed_gbs", 0.0) * 1e9
        every_mixed = every_mixed and found.get("mixed_gbs", 0.0) > 0
    return DiskSpeed(read, write, mixed if every_mixed else 0.0) if paths else None


@contextmanager
def _offload_io(size_bytes: int, bytes_per_s: float = 0.0) -> Iterator[tuple[Any, torch.Tensor]]:
    """A pinned buffer of ``size_bytes`` and zinf's AsyncIO with the offload engine's settings (O_DIRECT;
    ``bytes_per_s``: its ``offload.aio_bytes_per_s`` cap), as both measurements use them."""
    from zinf import native
    from zinf.config_sections import OffloadConfig

    native.require()
    cfg = OffloadConfig()
    pool = native.PinnedBufferPool(1 << (size_bytes - 1).bit_length())  # its blocks are powers of two
    buf = pool.acquire(size_bytes)
    try:
        with native.AsyncIO(block_size=cfg.aio_block_bytes, queue_depth=cfg.aio_queue_depth,
                            num_threads=cfg.aio_threads, direct=True, bytes_per_s=bytes_per_s) as aio:
            yield aio, buf
    finally:
        pool.release(buf)
        pool.close()


def measured_bytes(size_bytes: int) -> int:
    """The test file :func:`measure_path` writes for ``size_bytes``: whole 4 KiB blocks (O_DIRECT), rounded down."""
    if size_bytes < 4096:
        raise ValueError(f"a disk measurement needs at least 4096 bytes, got {size_bytes}")
    return size_bytes // 4096 * 4096


def measure_path(path: str, size_bytes: int, bytes_per_s: float = 0.0) -> tuple[float, float, float, bool]:
    """Sequential write then read of one ``size_bytes`` file in ``path`` through zinf's AsyncIO, with the
    offload engine's settings (``bytes_per_s``: its ``offload.aio_bytes_per_s`` cap), then its first half read while
    as many bytes are written to a second file; returns (write GB/s, read GB/s, reads and writes at once GB/s,
    whether O_DIRECT was in effect). The file holds :func:`measured_bytes` (``size_bytes`` in whole 4 KiB blocks; less
    than one block is refused). The files are removed afterwards."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{path!r} is not a directory (give the directory offload.nvme_paths would name)")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{path!r} is not writable by this process")
    size_bytes = measured_bytes(size_bytes)
    free = shutil.disk_usage(directory).free
    if free < size_bytes:
        raise ValueError(f"{path!r} has {free / 2**20:.0f} MiB free, the test needs {size_bytes / 2**20:.0f} MiB "
                         "(lower --size-mib)")
    target = directory / f"zinf-info-{os.getpid()}.tmp"
    second = directory / f"zinf-info-{os.getpid()}-2.tmp"
    try:
        with _offload_io(size_bytes, bytes_per_s) as (aio, buf):
            buf.random_(0, 256)
            start = time.perf_counter()
            aio.wait(aio.submit_write(buf, target))
            _fsync(target)
            write_s = time.perf_counter() - start
            direct = aio.direct
            start = time.perf_counter()
            aio.wait(aio.submit_read(buf, target))
            read_s = time.perf_counter() - start
            half = max(4096, size_bytes // 2 // 4096 * 4096)
            start = time.perf_counter()
            for handle in (aio.submit_read(buf[:half], target), aio.submit_write(buf[-half:], second)):
                aio.wait(handle)
            _fsync(second)
            mixed_s = time.perf_counter() - start
    finally:
        target.unlink(missing_ok=True)
        second.unlink(missing_ok=True)
    return size_bytes / write_s / _GB, size_bytes / read_s / _GB, 2 * half / mixed_s / _GB, direct


def measure_read(path: Path, nbytes: int = 256 << 20) -> float | None:
    """Bytes per second of a sequential read of up to ``nbytes`` of an existing file (read only, through the same
    AsyncIO; the faster of two reads, as :func:`measure_path` reads a file it has just written); None without the
    native build, O_DIRECT, or 4 KiB of file."""
    from zinf import native

    size = min(nbytes, os.path.getsize(path)) // 4096 * 4096
    if size == 0 or not native.info().available:
        return None
    with _offload_io(size) as (aio, buf):
        seconds = float("inf")
        for _ in range(2):  # the faster of two: a first read may wake a cold drive (or a VM host's cache)
            start = time.perf_counter()
            aio.wait(aio.submit_read(buf, path))
            seconds = min(seconds, time.perf_counter() - start)
        direct = aio.direct
    return size / seconds if direct and seconds > 0 else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # what is written is on the drive, not in a cache
    finally:
        os.close(fd)
