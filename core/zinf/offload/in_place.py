"""Frozen shards read from the checkpoint's own files, where they lie.

[Note: frozen shards in place]
A LoRA base loaded from a safetensors checkpoint on local disk is already on a drive, at its storage width. A group
whose parameters the files hold in its storage dtype (see [Note: reading at the storage width] in
zinf/checkpoint/pretrained.py) and whose shard waits in a construction spill (``offload.params: nvme`` under
``zinf.Init``) is not written to the spill: the loader records where each of this rank's bytes lies in the files
(an :class:`InPlaceRecord`: extents of the files, the zero gaps between them, the CRC32C of the whole shard and
each file's identity) and the spill reads it from there. At the placement, a group that trains nothing keeps the
record: the NVMe parameter store reads its shard from the files into a pool buffer like any swap record, and
never allocates swap for it (``offload.frozen_in_place``). A group that trains is copied into swap as before; a
write to a group before the placement (a re-initialisation, another load) drops its record and writes the spill.

So loading such a base writes nothing, and the drive holds the model once. The files are opened read-only and
never written. Each read checks every file it touched against the size, modification time and inode seen at load,
and the bytes against the CRC32C taken at load (without the native build: the identity alone): a checkpoint
changed, replaced or truncated under a run is an error naming the file, never values trained on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zinf import native
from zinf.errors import ZinfError

__all__ = ["Extent", "InPlaceRecord", "CheckpointChangedError", "file_identity", "why_read_failed"]

_ALIGN = 4096


class CheckpointChangedError(ZinfError):
    """A checkpoint file that frozen shards are read from changed, moved or was truncated after loading."""


def why_read_failed(exc: BaseException) -> str:
    """What a failed read of a checkpoint file says about it."""
    if isinstance(exc, native.AIOShortReadError):
        return "it ends before the bytes it had at loading"
    if isinstance(exc, native.AIOMissingPathError):
        return "it is gone"
    return f"reading it failed ({exc})"


def file_identity(path: str) -> tuple[int, int, int, int]:
    """(device, inode, size, modification time in ns): what changes when a file is replaced, rewritten or cut."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class Extent:
    """``nbytes`` of ``path`` from ``offset``, at ``dest`` bytes into the shard."""

    path: str
    offset: int
    nbytes: int
    dest: int


@dataclass
class InPlaceRecord:
    """Where a frozen shard's bytes lie in the checkpoint's files; see [Note: frozen shards in place]."""

    name: str  # the group's, for messages
    nbytes: int  # the shard's bytes
    extents: list[Extent]
    gaps: list[tuple[int, int]]  # (start, end) byte ranges of the shard no file fills: zeros
    identities: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    crc: int | None = None  # CRC32C of the whole shard (gaps as zeros); None without the native build

    @classmethod
    def of(cls, name: str, nbytes: int, extents: list[Extent]) -> "InPlaceRecord":
        """A record of ``extents`` (in shard order, not overlapping), adjacent ones merged; checksum not taken yet."""
        merged: list[Extent] = []
        for e in sorted(extents, key=lambda e: e.dest):
            last = merged[-1] if merged else None
            if last is not None and last.path == e.path and last.offset + last.nbytes == e.offset \
                    and last.dest + last.nbytes == e.dest:
                merged[-1] = Extent(e.path, last.offset, last.nbytes + e.nbytes, last.dest)
            else:
                merged.append(e)
        gaps, at = [], 0
        for e in merged:
            if e.dest > at:
                gaps.append((at, e.dest))
            at = e.dest + e.nbytes
        if at < nbytes:
            gaps.append((at, nbytes))
        return cls(name, nbytes, merged, gaps, {e.path: file_identity(e.path) for e in merged})

    @property
    def span(self) -> int:
        """Bytes of the pool buffer it is read into."""
        return max(_ALIGN, (self.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)

    @property
    def path(self) -> str:
        """The first file (for messages that name one)."""
        return self.extents[0].path if self.extents else "<no file>"

    def seal(self, data: torch.Tensor) -> None:
        """Take the checksum of ``data``, the shard's bytes as the loader read them."""
        if native.checksum_backend() != "python":
            self.crc = native.crc32c(data.view(torch.uint8)[: self.nbytes])

    # -- reads -------------------------------------------------------------------------------------
    def zero_gaps(self, buf: torch.Tensor) -> None:
        raw = buf.view(torch.uint8)
        for a, b in self.gaps:
            raw[a:b].zero_()

    def submit(self, aio: Any, buf: torch.Tensor) -> list[int]:
        """Start reading the shard into ``buf`` (uint8, at least ``nbytes``): one request per extent."""
        self.zero_gaps(buf)
        return [aio.submit_read(buf[e.dest : e.dest + e.nbytes], e.path, e.offset) for e in self.extents]

    def read_with(self, aio: Any, buf: torch.Tensor) -> None:
        """Read the shard into ``buf`` now, every extent in flight at once (not checked: ``check`` does that)."""
        failed: BaseException | None = None
        for h in self.submit(aio, buf.view(torch.uint8)):
            try:
                aio.wait(h)
            except native.AIOError as exc:
                failed = failed or exc
        if failed is not None:
            raise self.changed(getattr(failed, "path", self.path), why_read_failed(failed)) from failed

    def check(self, buf: torch.Tensor) -> None:
        """After a read into ``buf``: every file as it was at loading, and the bytes' checksum the one taken then."""
        for path, seen in self.identities.items():
            try:
                now = file_identity(path)
            except FileNotFoundError as exc:
                raise self.changed(path, "it is gone") from exc
            if now != seen:
                what = "replaced" if now[:2] != seen[:2] else f"resized ({seen[2]} -> {now[2]} bytes)" \
                    if now[2] != seen[2] else "modified"
                raise self.changed(path, f"it was {what} since loading")
        if self.crc is not None:
            actual = native.crc32c(buf.view(torch.uint8)[: self.nbytes])
            if actual != self.crc:
                raise self.changed(self.path, f"the bytes read have CRC32C {actual:#010x}, {self.crc:#010x} at loading")

    def changed(self, path: str, why: str) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"zinf: {self.name}'s frozen values are read from the checkpoint file {path}, and {why}. Refusing to "
            "train on them. Leave checkpoint files untouched while a run reads them, or set "
            "offload.frozen_in_place: false to copy frozen shards to the swap files at the start.")
