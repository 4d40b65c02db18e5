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

[Note: one pass per byte]
A frozen shard read from the files was passed over twice before the compute saw it: its checksum, then the widening
copy (bf16 to fp32) into the full buffer. Where the gather makes that copy from the store's own buffer (a group every
rank reads whole, or one rank's shard widened where it was read), the store leaves the checksum to it (``fetch(...,
defer_check=True)``, then ``take_check``): the copy takes the CRC32C of each block it reads while the block is in
the core's cache (``zinf.native.widen.copy_checked``) and verifies it (a
:class:`~zinf.native.checksum.ContentCheck`) in ``start_gather``, before the group leaves SHARDED, so a refused shard
unwinds the pass as a failed read does; its slot is dropped, and a file put back is read again. The files'
identities are still checked when the read is waited for. An all-gathered shard keeps the check at the read: its
first copy (into the chunk buffers, or out of the ranks' shared pools) is made inside a collective the other ranks
are already in, where a refusal could not leave every rank's groups as they were.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from zinf import native
from zinf.errors import ZinfError

__all__ = ["Extent", "InPlaceRecord", "CheckpointChangedError", "aligned_empty", "file_identity", "why_read_failed"]

_ALIGN = 4096
_KEEP_ALIGN = 16  # a shard used where it landed starts at a multiple of this: a view of any dtype is aligned


def _align_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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


@dataclass(frozen=True)
class _Read:
    """One request: ``nbytes`` of ``path`` from the block-aligned ``offset``, to the block-aligned ``at`` of the
    buffer; its extent's bytes start ``head`` bytes in."""

    path: str
    offset: int
    nbytes: int
    at: int
    head: int


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` whose address is block-aligned (direct reads need it)."""
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % _ALIGN
    return raw[skip : skip + nbytes]


@dataclass
class InPlaceRecord:
    """Where a frozen shard's bytes lie in the checkpoint's files; see [Note: frozen shards in place].

    [Note: reading extents directly]
    A tensor's bytes start anywhere in a safetensors file and land anywhere in the shard, but direct I/O (no page
    cache: a model read twice a step would otherwise fill the host's memory with cache and its reclaim) needs
    block-aligned file offsets and buffer addresses. So each extent is read as the blocks that cover it, to a
    block-aligned place of the buffer at or above where its bytes belong (``_Read.at``), and moved down into place
    when the reads are done (``compact``), in shard order: every move goes down, and never over bytes not moved yet.
    The buffer (``span``) is the shard plus at most two blocks an extent. A shard that is one extent (one tensor's
    slice: most groups of a transformer) is not moved at all: it is used where it landed, ``start`` bytes into the
    buffer (when that keeps any dtype's alignment), its padding zeroed after it. Moving it cost a pass over every
    byte of the base at each gather (a 13B base, 12 GB a rank, twice a step).
    """

    name: str  # the group's, for messages
    nbytes: int  # the shard's bytes
    extents: list[Extent]
    gaps: list[tuple[int, int]]  # (start, end) byte ranges of the shard no file fills: zeros
    reads: list[_Read]
    identities: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    crc: int | None = None  # CRC32C of the whole shard (gaps as zeros); None without the native build
    start: int = 0  # where the shard starts in the buffer it is read into (0: compacted there)
    ranks: int = 1  # the ranks' shards it holds end to end (more than one: [Note: frozen groups read whole])

    @classmethod
    def of(cls, name: str, nbytes: int, extents: list[Extent],
           identities: dict[str, tuple[int, int, int, int]] | None = None) -> "InPlaceRecord":
        """A record of ``extents`` (in shard order, not overlapping), adjacent ones merged; checksum not taken yet.
        ``identities``: the files as seen at loading (default: as they are now)."""
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
        identities = {e.path: identities[e.path] if identities else file_identity(e.path) for e in merged}
        reads, end = [], 0  # [Note: reading extents directly]
        for e in merged:
            first = e.offset // _ALIGN * _ALIGN
            last = min(_align_up(e.offset + e.nbytes), identities[e.path][2])  # the file may end mid-block
            head = e.offset - first
            place = _align_up(max(end, e.dest - head))
            reads.append(_Read(e.path, first, last - first, place, head))
            end = place + _align_up(last - first)
        # one extent, its first byte aligned for any dtype: used where it lands (see [Note: reading extents directly])
        start = reads[0].head if len(merged) == 1 and merged[0].dest == 0 and reads[0].head % _KEEP_ALIGN == 0 else 0
        return cls(name, nbytes, merged, gaps, reads, identities, start=start)

    @property
    def span(self) -> int:
        """Bytes of the (block-aligned) buffer it is read into."""
        end = self.reads[-1].at + self.reads[-1].nbytes if self.reads else 0
        return max(_ALIGN, _align_up(max(self.start + self.nbytes, end)))

    def shard_of(self, buf: torch.Tensor) -> torch.Tensor:
        """The shard's bytes in ``buf`` (uint8), once read and compacted (of a whole group: every rank's)."""
        return buf.view(torch.uint8)[self.start : self.start + self.nbytes]

    def rank_of(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard in ``buf`` (uint8): the record's own, or that rank's part of a whole group's."""
        size = self.nbytes // self.ranks
        return self.shard_of(buf)[rank * size : (rank + 1) * size] if self.ranks > 1 else self.shard_of(buf)

    @property
    def path(self) -> str:
        """The first file (for messages that name one)."""
        return self.extents[0].path if self.extents else "<no file>"

    def seal(self, data: torch.Tensor) -> None:
        """Take the checksum of ``data``, the shard's bytes as the loader read them."""
        if native.checksum_backend() != "python":
            self.crc = native.crc32c(self.shard_of(data))

    # -- reads -------------------------------------------------------------------------------------
    def submit(self, aio: Any, buf: torch.Tensor) -> list[int]:
        """Start reading into ``buf`` (uint8, block-aligned, ``span`` bytes): one request per extent. The shard is
        in place once every request is waited for and ``compact`` has run."""
        assert buf.numel() >= self.span and buf.data_ptr() % _ALIGN == 0, (buf.numel(), self.span, buf.data_ptr())
        return [aio.submit_read(buf[r.at : r.at + r.nbytes], r.path, r.offset) for r in self.reads]

    def compact(self, buf: torch.Tensor) -> None:
        """After the reads: each extent's bytes moved down to where the shard has them, the gaps zeroed (a shard used
        where it landed: only its gaps)."""
        raw = buf.view(torch.uint8)
        if self.start:
            for a, b in self.gaps:
                raw[self.start + a : self.start + b].zero_()
            return
        base = buf.data_ptr()
        for r, e in zip(self.reads, self.extents):
            if r.at + r.head != e.dest:
                ctypes.memmove(base + e.dest, base + r.at + r.head, e.nbytes)  # overlapping ranges: memmove
        for a, b in self.gaps:
            raw[a:b].zero_()

    def finish(self, aio: Any, handles: list[int], buf: torch.Tensor) -> None:
        """Wait for the requests ``submit`` started (every one, even after one failed: the buffer goes back) and
        compact the shard in ``buf``; a failed request is reported as the checkpoint's change."""
        failed: BaseException | None = None
        for h in handles:
            try:
                aio.wait(h)
            except native.AIOError as exc:
                failed = failed or exc
        if failed is not None:
            raise self.changed(getattr(failed, "path", self.path), why_read_failed(failed)) from failed
        self.compact(buf)

    def read_with(self, aio: Any, buf: torch.Tensor) -> None:
        """Read the shard into ``buf`` (uint8, block-aligned, ``span`` bytes) now, every extent in flight at once,
        and compact it (not checked: ``check`` does that)."""
        self.finish(aio, self.submit(aio, buf), buf)

    def check(self, buf: torch.Tensor, content: bool = True) -> None:
        """After a read into ``buf``: every file as it was at loading, and (``content``) the bytes' checksum the one
        taken then; without ``content`` the caller takes the checksum as it copies the bytes ([Note: one pass per
        byte])."""
        for path, seen in self.identities.items():
            try:
                now = file_identity(path)
            except FileNotFoundError as exc:
                raise self.changed(path, "it is gone") from exc
            if now != seen:
                what = "replaced" if now[:2] != seen[:2] else f"resized ({seen[2]} -> {now[2]} bytes)" \
                    if now[2] != seen[2] else "modified"
                raise self.changed(path, f"it was {what} since loading")
        if content and self.crc is not None:
            self.check_crc(native.crc32c(self.shard_of(buf)))

    def check_crc(self, actual: int) -> None:
        """The CRC32C of the bytes read is the one taken at loading."""
        if actual != self.crc:
            raise self.changed(self.path, f"the bytes read have CRC32C {actual:#010x}, {self.crc:#010x} at loading")

    def changed(self, path: str, why: str) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"zinf: {self.name}'s frozen values are read from the checkpoint file {path}, and {why}. Refusing to "
            "train on them. Leave checkpoint files untouched while a run reads them, or set "
            "offload.frozen_in_place: false to copy frozen shards to the swap files at the start.")
