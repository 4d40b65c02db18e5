"""Every rank's NVMe staging pool in shared memory, so a shard read into one rank's pool is gathered by the others
straight from there.

[Note: gathering from the ranks' pools]
A shard the NVMe store reads for a gather (a frozen group read in place from the checkpoint's files, or any group
swapped to NVMe) lands in a block of the rank's staging pool. Through the chunk buffers of [Note: same-host
collectives] in zinf/runtime/same_host.py every rank then copied it once more, into its chunk buffer, and posted a
flag at every 8 MiB, so the ranks met at every chunk: 1,500 meetings a pass for a 13B's half of the base.

With ``overlap.shared_memory: auto`` the pool itself lies in ``/dev/shm`` (one segment a rank, made when the
placement builds the pool, mapped by its rank and opened read-only by the others, then unlinked), so the ranks' reads
already land where every rank can read them. An all-gather larger than one chunk then runs in two meetings, whatever
its size (one no larger still goes through the chunk buffers, in its one meeting: the call's sizes, so the choice,
are the same on every rank):

1. each rank writes, in its header, where each shard of the call lies in its own pool (its offset, or -1 where it
   lies elsewhere), and posts; once every rank posted, a shard that lies in every rank's pool is gathered directly:
   every rank copies (or widens: [Note: a widening gather]) every rank's shard from that rank's pool into its rows;
   the rest go through the chunk buffers as before;
2. each rank posts once more after its copies out: once every rank did, every rank has read every other's pool, and
   the blocks may go back to their pools (the call returns only then).

The values are the same bytes in the same rows as through the chunk buffers. What changes is one copy fewer of this
rank's shard, two meetings a call instead of one a chunk, and ``copied_bytes`` / ``direct_bytes`` in the transport's
counts. A call larger than a chunk whose shards lie in no pool pays the first meeting for nothing. The pool's own
pages are counted once (``pinned_pool``) by its rank. The other ranks' pools are read with ``preadv`` from their
files, never mapped here: their pages, the same on the host, would otherwise count in this process's RSS as well as
in their own. A shard of the same dtype is read straight into its row (the kernel's one copy); one widened is read a
MiB at a time into a buffer that stays in the core's cache, and widened from there.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Iterator, Sequence

import torch

from zinf.errors import ZinfError

__all__ = ["PoolPeers", "TABLE_ENTRIES"]

TABLE_OFFSET = 128  # in a rank's header: after the flag's and the closed mark's cache lines
TABLE_ENTRIES = (4096 - TABLE_OFFSET) // 8 - 1  # int64 offsets after the count; a call's later shards are copied
BOUNCE_BYTES = 1 << 20  # another rank's shard widened: read a piece at a time into a buffer that stays in the cache


class PoolPeers:
    """This rank's pool segment, mapped, and every other rank's, open to read (``SameHostTransport.share_pool``)."""

    def __init__(self, maps: Sequence["mmap.mmap | int"], rank: int) -> None:
        own = maps[rank]
        assert isinstance(own, mmap.mmap)
        self._fds = {r: fd for r, fd in enumerate(maps) if isinstance(fd, int)}
        self._base = torch.frombuffer(own, dtype=torch.uint8).data_ptr()
        self._end = self._base + len(own)
        self._bounce = torch.empty(0, dtype=torch.uint8)  # a widened shard's pieces, read from another pool

    def offset_of(self, shard: torch.Tensor) -> int:
        """Where ``shard``'s bytes start in this rank's pool; -1 where they do not lie in it whole."""
        start = shard.data_ptr()
        if not shard.is_contiguous() or shard.device.type != "cpu" or not self._base <= start:
            return -1
        return start - self._base if start + shard.numel() * shard.element_size() <= self._end else -1

    def read_into(self, r: int, offset: int, out: torch.Tensor) -> None:
        """Rank r's bytes at ``offset`` of its pool into ``out`` (contiguous bytes): one copy, by the kernel."""
        # a view of the bytes by address: ``out.numpy()`` would leave its storage unresizable for good, where the
        # gathers' buffers are released by resizing theirs ([Note: releasing memory] in zinf/param/layout.py)
        view, done = memoryview((ctypes.c_char * out.numel()).from_address(out.data_ptr())).cast("B"), 0
        while done < len(view):
            n = os.preadv(self._fds[r], [view[done:]], offset + done)
            if n <= 0:
                raise ZinfError(f"zinf: rank {r}'s staging pool ended {offset + done} bytes in, while this rank read "
                                f"{len(view)} bytes of it at {offset}; set overlap.shared_memory: chunks")
            done += n

    def read_in_pieces(self, r: int, offset: int, nbytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Rank r's ``nbytes`` at ``offset`` of its pool, in pieces through one buffer of ``BOUNCE_BYTES``: (start
        within them, the piece's bytes), each piece valid until the next."""
        if self._bounce.numel() < min(nbytes, BOUNCE_BYTES):
            self._bounce = torch.empty(BOUNCE_BYTES, dtype=torch.uint8)
        for start in range(0, nbytes, BOUNCE_BYTES):
            piece = self._bounce[: min(BOUNCE_BYTES, nbytes - start)]
            self.read_into(r, offset + start, piece)
            yield start, piece

    def close(self) -> None:
        """Close the other ranks' pools; the own pool's map lives on with the pool."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def write_table(header: torch.Tensor, offsets: Sequence[int]) -> None:
    """This rank's offsets (a call's shards, in order) into its header, before it posts."""
    table = header[TABLE_OFFSET : TABLE_OFFSET + 8 * (TABLE_ENTRIES + 1)].view(torch.int64)
    table[0] = len(offsets)
    table[1 : 1 + len(offsets)] = torch.tensor(offsets, dtype=torch.int64)


def read_table(header: torch.Tensor) -> list[int]:
    """A rank's offsets as it wrote them for the current call."""
    table = header[TABLE_OFFSET : TABLE_OFFSET + 8 * (TABLE_ENTRIES + 1)].view(torch.int64)
    return table[1 : 1 + int(table[0])].tolist()
