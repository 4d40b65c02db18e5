"""Construction straight to NVMe: the parameter shards ``zinf.Init`` builds go to a file of this rank as soon as each
module is built, until the engine's placement takes them.

[Note: construction spill]
Under ``zinf.Init`` with ``offload.params: nvme``, a module's shard is written to this rank's spill file (in the
first of ``offload.nvme_paths``) right after the module is partitioned, and its memory is freed; the fp32 master is
kept only where the storage dtype cannot hold the values exactly (16-bit storage of values initialised in fp32):
with fp32 storage the shard is the master, and 16-bit weights read from 16-bit files need none (the master is the
stored shard widened, made when the engine is built, for trainable groups only). So building a model larger than
host memory holds one module at a time, plus what construction itself allocates.

The spill is an ordinary ``ShardStore`` (zinf/param/store.py): a group that is gathered during construction (a
parent's initialisation, ``GatheredParameters``, the pretrained loader) reads its shard from the file and writes
its edit back. The engine's placement then takes each shard (``take``: read back, one group at a time) and moves it
to its final tier (the swap files, host memory or the device); the file is removed when the last group has left
(taken, or dropped with its model), and at exit in any case. Records are 4 KiB-aligned; a record never written (the placeholders of a model whose
weights a loader is about to read) reads as zeros (a sparse file). The CRC32C of every record written is kept in
memory and checked when it is read back, as the swap files' records are (see [Note: offload file format] in
zinf/offload/swap.py): a shard corrupted on the drive is an error naming the file, never values trained on (without
the native build no checksum is taken).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import socket
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from zinf import native
from zinf.file_io import read_at, write_at
from zinf.heap import HeapTrimmer
from zinf.offload import cleanup
from zinf.offload.in_place import InPlaceRecord, aligned_empty
from zinf.offload.swap import OffloadFileError, OffloadSpaceError, align_up, check_dir

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["SpillStore"]

log = logging.getLogger(__name__)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Give a record's disk blocks back to the file system (a drive that holds the spill and the swap files then
    never holds a shard twice). Where the file system cannot, the space is freed when the file is removed."""
    _libc.fallocate(ctypes.c_int(fd), ctypes.c_int(_FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE),
                    ctypes.c_long(offset), ctypes.c_long(nbytes))


class SpillStore:
    """This rank's construction spill file; see [Note: construction spill]."""

    tier = "nvme"

    def __init__(self, directory: str, rank: int, in_place: bool = True) -> None:
        directory = os.path.abspath(directory)
        check_dir(directory)
        cleanup.collect_leftovers([directory])  # a killed run's spill and swap files (see [Note: clean stops])
        self.path = os.path.join(directory, f"zinf-init-{socket.gethostname()}-{os.getpid()}-r{rank}.spill")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        cleanup.lock(self._fd)
        cleanup.register([self.path])
        self._lock = threading.Lock()
        self._where: dict[int, tuple[int, int]] = {}  # group id -> (offset, bytes)
        self._crc: dict[int, int] = {}  # group id -> CRC32C of the bytes written there (none for placeholders)
        self._checksums = native.checksum_backend() != "python"
        self._end = 0
        self._pending: dict[int, torch.Tensor] = {}  # writer() buffers until commit()
        self._scratch = torch.empty(0, dtype=torch.uint8)  # writer()'s buffer, reused group after group
        self._heap = HeapTrimmer()
        # loaded shards whose bytes are read from checkpoint files (see [Note: frozen shards in place])
        self.in_place = in_place
        self._in_place: dict[int, InPlaceRecord] = {}
        self._aio: native.AsyncIO | native.PythonAsyncIO | None = None  # their reads, made on the first
        self._aligned_scratch = torch.empty(0, dtype=torch.uint8)

    # -- construction --------------------------------------------------------------------------------
    def add(self, group: "FlatParamGroup", shard: torch.Tensor | None) -> None:
        """Give ``group`` a record and write ``shard`` there (None: placeholders, left unwritten: they read as zeros)."""
        nbytes = group.shard_nbytes
        with self._lock:
            self._where[id(group)] = (self._end, nbytes)
            self._end += align_up(nbytes)
        weakref.finalize(group, self._forget, id(group))  # a model dropped before any engine took it
        if shard is not None:
            self._write(group, shard)
        self._heap.count(nbytes * 3)  # the module's values, its fp32 master and shard were freed (see heap.py)

    def keep_in_place(self, group: "FlatParamGroup", record: InPlaceRecord) -> None:
        """[Note: frozen shards in place]: ``group``'s shard lies in checkpoint files as ``record`` says; it is read
        once (many requests in flight), for the checksum. Nothing is written."""
        with self._lock:
            nbytes = self._where[id(group)][1]
        assert record.nbytes == nbytes, (group.name, record.nbytes, nbytes)
        buf = self._aligned(record.span)
        record.read_with(self._reader(), buf)
        record.seal(buf)
        with self._lock:
            self._in_place[id(group)] = record

    def _reader(self) -> "native.AsyncIO | native.PythonAsyncIO":
        if self._aio is None:
            try:
                self._aio = native.AsyncIO()
            except ImportError:
                self._aio = native.PythonAsyncIO()
        return self._aio

    def _aligned(self, nbytes: int) -> torch.Tensor:
        """The in-place reads' buffer (block-aligned, see [Note: reading extents directly]), kept for the next group."""
        if self._aligned_scratch.numel() < nbytes:
            self._aligned_scratch = aligned_empty(nbytes)
        return self._aligned_scratch[:nbytes]

    def in_place_record(self, group: "FlatParamGroup") -> InPlaceRecord | None:
        """Where ``group``'s shard lies in checkpoint files, if it does (not written here since it was loaded)."""
        return self._in_place.get(id(group))

    def take_in_place(self, group: "FlatParamGroup") -> InPlaceRecord:
        """The placement keeps ``group``'s shard where it lies: its record is handed over, nothing is read."""
        record = self._in_place[id(group)]
        self._forget(id(group))
        return record

    def take(self, group: "FlatParamGroup") -> torch.Tensor:
        """The engine's placement takes ``group``'s shard: read back into memory, then the record is forgotten."""
        shard = self.read(group)
        self._forget(id(group))
        self._heap.count(shard.numel() * shard.element_size())
        return shard

    def _forget(self, key: int) -> None:
        """A group's record is given up (taken, or its model dropped): its disk space goes back (a hole punched), and
        the file is removed once no record is left."""
        with self._lock:
            where = self._where.pop(key, None)
            self._crc.pop(key, None)
            self._in_place.pop(key, None)
            empty = not self._where
        if where is not None and self._fd >= 0:
            _punch_hole(self._fd, where[0], align_up(where[1]))
            if empty:
                self.close()

    # -- the store protocol ----------------------------------------------------------------------------
    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        return True

    def fetch(self, group: "FlatParamGroup", defer_check: bool = False) -> torch.Tensor:
        return self.read(group).to(group.device)

    def take_check(self, group: "FlatParamGroup") -> None:
        return None

    def done(self, group: "FlatParamGroup") -> None:
        return None

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        """A buffer for ``group``'s new shard, written by ``commit``: one kept for the next group when no other
        write is pending (a loader writes group after group; fresh pages would be faulted in for every one)."""
        nbytes = group.shard_nbytes
        if self._pending:
            buf = group.format.empty_shards(1, group.shard_numel, torch.device("cpu"))
        else:
            if self._scratch.numel() < nbytes:
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            buf = self._scratch[:nbytes].view(group.storage_dtype)
        self._pending[id(group)] = buf
        return buf

    def commit(self, group: "FlatParamGroup") -> None:
        self._write(group, self._pending.pop(id(group)))

    def keep_for_backward(self, keep: bool) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self._scratch = self._aligned_scratch = torch.empty(0, dtype=torch.uint8)
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        cleanup.unregister([self.path])
        log.debug("zinf.Init: spill file %s removed", self.path)

    def bytes_by_tier(self) -> dict[str, int]:
        with self._lock:
            return {"nvme": sum(align_up(n) for _, n in self._where.values())}

    # -- I/O ------------------------------------------------------------------------------------------
    def _write(self, group: "FlatParamGroup", shard: torch.Tensor) -> None:
        self._in_place.pop(id(group), None)  # new values: the record holds them from now on
        offset, nbytes = self._where[id(group)]
        data = shard.detach().to("cpu", group.storage_dtype).contiguous()
        assert data.numel() * data.element_size() == nbytes, (group.name, data.numel(), nbytes)
        try:
            write_at(self._fd, data, offset)
        except OSError as exc:
            raise OffloadSpaceError(
                f"zinf.Init: writing {group.name}'s shard to {self.path} failed ({exc}). Free space on that drive "
                "or name another in offload.nvme_paths.") from exc
        if self._checksums:
            self._crc[id(group)] = native.crc32c(data)
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        """``group``'s shard, read into memory (the record stays)."""
        offset, nbytes = self._where[id(group)]
        out = group.format.empty_shards(1, group.shard_numel, torch.device("cpu"))
        record = self._in_place.get(id(group))
        if record is not None:
            buf = self._aligned(record.span)
            record.read_with(self._reader(), buf)
            record.check(buf)
            out.view(torch.uint8).copy_(record.shard_of(buf))
            return out
        got = read_at(self._fd, out, offset)
        if got < nbytes:  # past the end: a record never written (placeholders) reads as zeros
            out.view(torch.uint8)[got:].zero_()
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        self._check(group, out, offset, nbytes)
        return out

    def _check(self, group: "FlatParamGroup", data: torch.Tensor, offset: int, nbytes: int) -> None:
        """The bytes read back are those written (see [Note: construction spill])."""
        crc = self._crc.get(id(group))
        if crc is None:
            return
        actual = native.crc32c(data)
        if actual != crc:
            raise OffloadFileError(
                f"zinf.Init: the spill file {self.path} holds {group.name}'s shard at offset {offset} ({nbytes} "
                f"bytes), and it is corrupted: its CRC32C is {actual:#010x}, {crc:#010x} was written. Refusing to train "
                "on it; check the drive (dmesg, smartctl), or name another in offload.nvme_paths, and build the model "
                "again.")
