"""NVMe swap space: this rank's offloaded tensors, in preallocated files striped across paths.

[Note: offload file format]
Each rank owns one file per NVMe path, ``zinf-r{rank}-of-{world}-{run}.swap``. The first 4096 bytes
are a header (magic, format version, run id, rank, world, size). Every record (one tensor: a
parameter shard, a master shard, a moment) starts 4096-aligned and ends in a 64-byte trailer
inside its padded length: magic, run id, record id, generation (bumped on every write), data
size and the CRC32C of the data (computed by the native core as the record is written). Every read
checks the trailer against what this run last wrote there and the data against its checksum, so a
truncated, foreign (another run's or another rank's), stale or corrupted record is an error naming
the file, the record and its offset instead of numbers trained on. Without the native build the
checksum is not taken (a pure-Python CRC would be slower than the disk); a warning says so.
Files are preallocated (``posix_fallocate``) when the engine starts: a path without room fails
then, naming the path, the bytes needed and free, and the setting to change.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zinf import native
from zinf.offload import cleanup
from zinf.offload.in_place import InPlaceRecord
from zinf.errors import ZinfError
from zinf.report import StepTimers

__all__ = ["OffloadFileError", "OffloadSpaceError", "Record", "SwapSpace", "ALIGN", "TRAILER_BYTES", "record_span"]

log = logging.getLogger(__name__)

ALIGN = 4096
TRAILER_BYTES = 64
_MAGIC, _REC_MAGIC, _VERSION = b"ZINFSWAP", b"ZINFREC1", 1
_TRAILER = struct.Struct("<8s16sQQQI")  # magic, run id, record id, generation, nbytes, crc32c of the data


class OffloadFileError(ZinfError):
    """An offload file is missing, truncated, foreign or stale, or an I/O request on it failed."""


class OffloadSpaceError(ZinfError):
    """An NVMe path is missing, not writable, or has too little free space for this placement."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def record_span(nbytes: int) -> int:
    """Bytes a record of ``nbytes`` occupies on disk (data, padding, trailer) and stages through in the pool."""
    return align_up(nbytes + TRAILER_BYTES)


@dataclass
class Record:
    """Where one offloaded tensor lives: file, offset, sizes; ``generation`` counts writes."""

    record_id: int
    path: str
    offset: int
    nbytes: int
    generation: int = 0

    def next_generation(self) -> int:
        """A write of the record begins: its trailer carries the next generation."""
        self.generation += 1
        return self.generation

    @property
    def span(self) -> int:
        """Bytes the record occupies on disk (data, padding, trailer), a multiple of 4096."""
        return record_span(self.nbytes)

    @property
    def start(self) -> int:
        """Where the data starts in the buffer it is read into (as a frozen shard read in place says)."""
        return 0


def _release(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _ranges(records: Sequence[Record]) -> list[tuple[int, int]]:
    """(offset, bytes) runs covering a file's header and ``records``, merged where they touch."""
    runs: list[list[int]] = [[0, ALIGN]]
    for r in sorted(records, key=lambda r: r.offset):
        if r.offset == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += r.span
        else:
            runs.append([r.offset, r.span])
    return [(a, n) for a, n in runs]


def _remove(files: list[str], held: list[int] | None = None) -> None:
    _release(held or [])
    for f in files:
        if os.path.exists(f):
            os.unlink(f)


def check_dir(d: str, setting: str = "offload.nvme_paths") -> None:
    """An offload directory exists and this process may write there, or an error naming the setting and the fix."""
    if not os.path.isdir(d):
        raise OffloadSpaceError(f"zinf offload: {setting} entry {d!r} does not exist. Create the directory "
                                f"(mkdir -p {d}) or point {setting} at an existing one.")
    if not os.access(d, os.W_OK):
        raise OffloadSpaceError(f"zinf offload: {setting} entry {d!r} is not writable by this process.")


class SwapSpace:
    """Lays out records across this rank's files, then reads and writes them through async I/O."""

    def __init__(self, paths: list[str], rank: int, world: int, aio: Any, setting: str = "offload.nvme_paths",
                 timers: StepTimers | None = None) -> None:
        self.setting = setting
        self.timers = timers or StepTimers()
        self.bytes_read = self.bytes_written = 0
        # set on threads whose waits are hidden behind training (the background optimizer step): their
        # waits are timed as "background_nvme_read" / "background_nvme_write"
        self._background: set[int] = set()  # thread idents
        self._kind: dict[int, tuple[str, int]] = {}  # handle -> ("nvme_read" | "nvme_write", bytes)
        # reads of frozen shards from checkpoint files (see [Note: frozen shards in place] in in_place.py): negative
        # handles, each the requests of one shard's extents
        self._in_place: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._next_in_place = -1
        self.rank, self.world = rank, world
        self.run_id = uuid.uuid4().bytes
        self.aio = aio
        self.dirs = [os.path.abspath(p) for p in paths]
        for d in self.dirs:
            check_dir(d, setting)
        tag = self.run_id.hex()[:8]
        self.files = [os.path.join(d, f"zinf-r{rank}-of-{world}-{tag}.swap") for d in self.dirs]
        self._ends = [ALIGN] * len(self.files)  # the header block comes first
        self.records: list[Record] = []
        self._opened = False
        self._fds: dict[str, int] = {}  # each file's descriptor once open, for deferred reservations
        self.checksums = native.checksum_backend() != "python"
        if not self.checksums:
            log.warning("zinf offload: the native build is missing, so offloaded records are written and read "
                        "without content checksums (corruption on disk would go unnoticed); %s", native._BUILD_HINT)

    # -- layout ---------------------------------------------------------------------------------
    def take_counts(self) -> tuple[int, int]:
        """Bytes read and written since the last call."""
        counts = (self.bytes_read, self.bytes_written)
        self.bytes_read = self.bytes_written = 0
        return counts

    def mark_background_thread(self) -> None:
        """The calling thread's waits are hidden behind training: time them as background I/O."""
        self._background.add(threading.get_ident())

    def allocate(self, nbytes: int) -> Record:
        """Reserve a record of ``nbytes`` on the path with the least allocated (striping)."""
        assert not self._opened, "allocate every record before open()"
        return self._lay_out(nbytes)

    def _lay_out(self, nbytes: int) -> Record:
        """A new record of ``nbytes`` at the end of the path with the least allocated."""
        i = min(range(len(self.files)), key=lambda k: self._ends[k])
        rec = Record(record_id=len(self.records), path=self.files[i], offset=self._ends[i], nbytes=nbytes)
        self._ends[i] += rec.span
        self.records.append(rec)
        return rec

    def allocate_late(self, nbytes: int) -> Record:
        """A record added after ``open``, its room reserved now: a frozen shard read from a checkpoint file that gets
        new values (see [Note: frozen shards in place] in in_place.py)."""
        assert self._opened, "allocate_late after open(); before it, allocate"
        rec = self._lay_out(nbytes)
        self.reserve(rec)
        return rec

    @property
    def bytes_per_path(self) -> dict[str, int]:
        return {d: end for d, end in zip(self.dirs, self._ends)}

    def open(self, deferred: Sequence[Record] = ()) -> None:
        """Remove files of dead runs, check free space on every path, then create, preallocate and stamp the files.
        ``deferred``: records whose room is reserved only when the placement writes them (``reserve``), because a
        construction spill on the same drive gives that room back first (see [Note: one copy on the drive])."""
        alive = cleanup.collect_leftovers(self.dirs)  # see [Note: clean stops] in zinf/offload/cleanup.py
        later = {id(r) for r in deferred}
        for d, f, end in zip(self.dirs, self.files, self._ends):
            # a spill record gives back its shard's bytes aligned; the swap record adds the trailer, up to a block more
            need = end - sum(r.span - ALIGN for r in deferred if r.path == f)
            free = shutil.disk_usage(d).free
            if need > free:
                others = [x for x in alive if os.path.dirname(x.path) == d]
                from zinf.units import format_bytes_apart

                need_text, free_text = format_bytes_apart(need, free)
                raise OffloadSpaceError(
                    f"zinf offload: {d!r} needs {need_text} for rank {self.rank}'s offloaded state but has "
                    f"{free_text} free. Free space there, add another drive to {self.setting}, or offload "
                    "less (offload.params / offload.optimizer)." + (
                        f" Swap files of other runs there hold {sum(x.nbytes for x in others) / 2**20:.1f} MiB: "
                        + "; ".join(f"{x.path} ({x.why})" for x in others[:4]) if others else ""))
        cleanup.register(list(self.files))  # from before they exist: a stop while creating them removes them too
        held: list[int] = []  # one fd per file, holding the lock that marks it as this live run's
        try:
            for f, end in zip(self.files, self._ends):
                fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                held.append(fd)
                # locked before its header says it is a zinf file: another rank's (or run's) search for files
                # of dead runs never takes a file being created for one (see [Note: clean stops])
                cleanup.lock(fd)
                for offset, nbytes in _ranges([r for r in self.records if r.path == f and id(r) not in later]):
                    self._reserve(fd, f, offset, nbytes)
                header = json.dumps({"magic": _MAGIC.decode(), "version": _VERSION, "run": self.run_id.hex(),
                                     "rank": self.rank, "world": self.world, "bytes": end, **cleanup.owner()}).encode()
                os.pwrite(fd, header.ljust(ALIGN, b"\0"), 0)
        except BaseException:
            _release(held)
            raise
        self._opened = True
        self._fds = dict(zip(self.files, held))
        # scratch, not checkpoints: removed by close(), and at interpreter exit after a failure too, so a
        # crashed run does not leave tens of GB behind (only a killed process can)
        self._cleanup = weakref.finalize(self, _remove, list(self.files), held)
        log.info("zinf offload: rank %d swap files %s", self.rank,
                 ", ".join(f"{f} ({e / 2**20:.0f} MiB)" for f, e in zip(self.files, self._ends)))

    def reserve(self, rec: Record) -> None:
        """Reserve the room of a record ``open`` deferred, before its first write."""
        self._reserve(self._fds[rec.path], rec.path, rec.offset, rec.span)

    def _reserve(self, fd: int, path: str, offset: int, nbytes: int) -> None:
        try:
            os.posix_fallocate(fd, offset, nbytes)
        except OSError as exc:
            raise OffloadSpaceError(f"zinf offload: cannot reserve {nbytes} bytes in {path}: {exc}. Free space on "
                                    f"that drive or change {self.setting}.") from exc

    def close(self, remove: bool = True) -> None:
        if remove:
            cleanup.unregister(list(self.files))
        finalizer = getattr(self, "_cleanup", None)
        if remove and finalizer is not None:
            finalizer()  # releases the files' locks and removes them
        elif finalizer is not None:
            info = finalizer.detach()
            if info is not None:
                _release(info[2][1])
        elif remove:
            _remove(self.files)

    # -- I/O ------------------------------------------------------------------------------------
    def stamp(self, rec: Record, buf: torch.Tensor, crc: int | None = None) -> None:
        """Write the trailer of ``rec``'s next generation into ``buf`` (a uint8 buffer of ``rec.span`` bytes); ``crc``:
        the data's CRC32C where the caller took it already (the CPU-Adam's checked pass)."""
        rec.next_generation()
        if crc is None:
            crc = self.checksum(rec, buf) if self.checksums else 0
        trailer = _TRAILER.pack(_REC_MAGIC, self.run_id, rec.record_id, rec.generation, rec.nbytes, crc)
        buf[rec.span - TRAILER_BYTES : rec.span - TRAILER_BYTES + len(trailer)].copy_(
            torch.frombuffer(bytearray(trailer), dtype=torch.uint8))

    def submit_write(self, rec: Record, buf: torch.Tensor, crc: int | None = None) -> int:
        """Write a whole record (data already in ``buf``); stamps the trailer first (see ``stamp``)."""
        self.stamp(rec, buf, crc)
        return self.submit_stamped(rec, buf)

    def submit_stamped(self, rec: Record, buf: torch.Tensor) -> int:
        """Write a whole record whose trailer ``stamp`` already wrote into ``buf``."""
        handle = self.aio.submit_write(buf[: rec.span], rec.path, rec.offset)
        self._kind[handle] = ("nvme_write", rec.span)
        return handle

    def submit_read(self, rec: Record | InPlaceRecord, buf: torch.Tensor) -> int:
        if isinstance(rec, InPlaceRecord):
            handle, self._next_in_place = self._next_in_place, self._next_in_place - 1
            self._in_place[handle] = (rec.submit(self.aio, buf), buf)
            self._kind[handle] = ("nvme_read", rec.nbytes)
            return handle
        handle = self.aio.submit_read(buf[: rec.span], rec.path, rec.offset)
        self._kind[handle] = ("nvme_read", rec.span)
        return handle

    def wait(self, handle: int, rec: Record | InPlaceRecord) -> None:
        """Wait for one request. On the training thread the time spent waiting is what the step could not
        hide behind compute; on a background thread (``mark_background_thread``) it is timed separately."""
        if isinstance(rec, InPlaceRecord):
            self._wait_in_place(handle, rec)
            return
        kind, nbytes = self._kind.pop(handle, ("nvme_read", 0))
        if kind == "nvme_read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        try:
            with self.timers.time(f"background_{kind}" if threading.get_ident() in self._background else kind):
                self.aio.wait(handle)
        except native.AIONoSpaceError as exc:
            raise OffloadSpaceError(
                f"zinf offload: {rec.path} is full (no space left while writing record {rec.record_id} at offset "
                f"{rec.offset}). Training stopped; checkpoints written before are untouched. Free space or add a "
                f"drive to {self.setting}.") from exc
        except native.AIOShortReadError as exc:
            raise OffloadFileError(f"zinf offload: {rec.path} is truncated: record {rec.record_id} at offset "
                                   f"{rec.offset} could not be read in full ({exc}).") from exc
        except native.AIOError as exc:
            raise OffloadFileError(f"zinf offload: I/O on {rec.path} failed at offset {rec.offset}: {exc}") from exc

    def _wait_in_place(self, handle: int, rec: InPlaceRecord) -> None:
        """Wait for every extent of a frozen shard's read and compact the shard in its buffer."""
        _, nbytes = self._kind.pop(handle, ("nvme_read", 0))
        self.bytes_read += nbytes
        handles, buf = self._in_place.pop(handle)
        with self.timers.time("background_nvme_read" if threading.get_ident() in self._background else "nvme_read"):
            rec.finish(self.aio, handles, buf)

    def verify(self, rec: Record | InPlaceRecord, buf: torch.Tensor, content: bool = True) -> None:
        """Check the trailer that was just read into ``buf`` (see [Note: offload file format]); a frozen shard read
        from a checkpoint, against the files and (``content``) the checksum seen at loading."""
        if isinstance(rec, InPlaceRecord):
            rec.check(buf, content)
            return
        crc = self.trailer_crc(rec, buf)
        if content and self.checksums:
            self.check_content(rec, self.checksum(rec, buf), crc)

    def trailer_crc(self, rec: Record, buf: torch.Tensor) -> int:
        """Check the trailer read into ``buf`` is this record's latest generation; return the data's CRC32C it holds
        (the caller checks the data against it: ``verify``, or ``check_content`` with a CRC taken elsewhere)."""
        raw = bytes(buf[rec.span - TRAILER_BYTES : rec.span - TRAILER_BYTES + _TRAILER.size].numpy().tobytes())
        magic, run, rid, gen, nbytes, crc = _TRAILER.unpack(raw)
        if magic != _REC_MAGIC:
            raise OffloadFileError(f"zinf offload: {rec.path} record {rec.record_id} at offset {rec.offset} is not a zinf "
                                   "record (the file was overwritten, truncated or is foreign).")
        if run != self.run_id or rid != rec.record_id:
            raise OffloadFileError(f"zinf offload: {rec.path} record {rec.record_id} belongs to another run or rank "
                                   f"(run {run.hex()[:8]}, record {rid}); refusing to train on it.")
        if gen != rec.generation or nbytes != rec.nbytes:
            raise OffloadFileError(f"zinf offload: {rec.path} record {rec.record_id} is stale (generation {gen}, "
                                   f"expected {rec.generation}); a write was lost.")
        return crc

    @staticmethod
    def check_content(rec: Record, actual: int, crc: int) -> None:
        """Refuse a record whose data's CRC32C (``actual``) is not the one its trailer holds (``crc``)."""
        if actual != crc:
            raise OffloadFileError(
                f"zinf offload: {rec.path} record {rec.record_id} at offset {rec.offset} ({rec.nbytes} bytes) is "
                f"corrupted: its data's CRC32C is {actual:#010x}, {crc:#010x} was written. Refusing to train on "
                "it; check the drive (dmesg, smartctl) and restart from the last checkpoint.")

    def checksum(self, rec: Record, buf: torch.Tensor) -> int:
        """A record's CRC32C on the CPU-Adam's threads: it runs between the sweep's steps, when they are free."""
        with self.timers.time("background_checksum" if threading.get_ident() in self._background else "checksum"):
            return native.crc32c(buf[: rec.nbytes], threads=native.require().adam.num_threads())
