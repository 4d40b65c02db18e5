"""Same-host collectives: the all-gathers and reduce-scatters of CPU ranks through shared memory.

[Note: same-host collectives]
gloo moves every byte through a TCP socket, even between two processes of one machine: the kernel copies it
into the socket and out again, on the cores that also compute. Measured on 2 ranks of a 2-core machine
(``benchmarks/bench_collectives.py``), 6.9M fp32 elements: all-gather 24 ms, reduce-scatter 37 ms, which is a
sixth of a GPT-2 step. When every rank of the group runs on one host, zinf's parameter all-gathers and gradient
reduce-scatters go through files in ``/dev/shm`` instead (``overlap.shared_memory``):

- each rank maps one segment of its own (a header with its flag and its closed mark, then two data buffers of
  ``CHUNK_BYTES``) and every other rank's; the files are unlinked once every rank mapped them, so nothing is left
  behind by a crash;
- an all-gather copies this rank's shard into its buffer, posts its flag (a sequence number, after a fence), waits
  until every rank posted the same number, then copies every rank's buffer into its row of the output: one
  copy in, one copy out, no syscall but the futex wake (a shard that lies in the ranks' shared staging pools skips
  the copy in: [Note: gathering from the ranks' pools] in zinf/runtime/shared_pool.py);
- a reduce-scatter copies the slices meant for the other ranks into its buffer, posts, waits, and sums, in rank
  order, the slices every rank left for it (its own from its input): with 2 ranks that is x0 + x1, gloo's sum bit
  for bit;
- larger tensors go through in chunks, and several tensors of one round share a chunk; the two buffers alternate,
  so a rank writes the next chunk while the others may still read the last one, and one wait per chunk is enough:
  before a rank posts chunk k+1, every rank posted chunk k, so every rank finished reading chunk k-1.

Collectives complete when called (the returned handle is None): every rank issues them in the same order (the
rounds of zinf/schedule/rounds.py see to it), so a rank waiting for the others always waits for something they
will do. A rank that does not post within the timeout (``collective_timeout_s``, else the process group's own:
``init_process_group(timeout=...)``, gloo's 30 minutes by default) raises :class:`~zinf.errors.SharedMemoryTimeout`,
which the collective watchdog reports like a gloo timeout. A rank that will never post again fails its waiters at
once, as gloo notices a closed socket: one that closed its transport (``engine.close()``) sets its closed mark (after
its last post) and wakes them, and they read the mark before each sleep on its flag; one whose process exited is
noticed within a fifth of a second (its PID, exchanged when the segments are set up, is looked up while the others
sleep on its flag).
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from zinf.errors import SharedMemoryTimeout, ZinfError
from zinf.runtime.comm import host_boot
from zinf.native import shm as native_shm
from zinf.native.widen import widen_into
from zinf.report import tier_of
from zinf.runtime.shm_files import SHM_DIR, map_segments
from zinf.runtime.shared_pool import TABLE_ENTRIES, PoolPeers, read_table, write_table

if TYPE_CHECKING:
    from zinf.runtime.comm import Comm

__all__ = ["CHUNK_BYTES", "SameHostTransport", "TransportState"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # one data buffer; a segment holds two, so 16 MiB of shared memory per rank
POOL_GATHER_MIN_BYTES = CHUNK_BYTES  # a call gathers from the ranks' pools above this (one chunk meets once)
_HEADER = 4096  # the flag, then the closed mark on a cache line of its own, alone on their page
_CLOSED = 64  # the closed mark's offset in the header: 1 once its rank closed the transport
_ALIGN = 64
_DEFAULT_TIMEOUT_S = 1800.0  # gloo's default, where the process group's own timeout cannot be read
_SPINS = 4000  # checks of a flag before sleeping on it (tens of microseconds), where every rank has a core


class TransportState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class _HostId:
    host: str
    boot: str
    pid_ns: str  # the same PID namespace: a rank can tell whether another one's process still runs
    shm_dir: bool
    native: bool


def _host_id() -> _HostId:
    host, boot = host_boot()
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    usable = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    return _HostId(host, boot, pid_ns, usable, native_shm.available())


def _group_timeout_s(group: Any) -> float:
    """The process group's own timeout in seconds (``init_process_group(timeout=...)``, ``new_group(timeout=...)``,
    or torch's ``_set_pg_timeout`` since): the one its gloo collectives run under. Read from its CPU backend's
    options, as torch's DeviceMesh reads it; gloo's default where this torch does not expose it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return _DEFAULT_TIMEOUT_S


class SameHostTransport:
    """The shared segments of one process group whose ranks share a host; made by :meth:`connect` (every rank
    together), closed by :meth:`close`."""

    def __init__(self, rank: int, world: int, maps: list[mmap.mmap], timeout_s: float, token: str,
                 pids: list[int]) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._pids = pids  # every rank's process, to notice one that exited while the others wait for it
        self.token = token  # in the names of the segments' files (unlinked once every rank mapped them)
        self._maps = maps
        self._segments = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self._flags = [s.data_ptr() for s in self._segments]
        self._closed = [f + _CLOSED for f in self._flags]
        self._seq = 0
        # more ranks than cores: a rank that spins takes the core from the one it waits for
        self._spins = _SPINS if world <= len(os.sched_getaffinity(0)) else 0
        self.ops = 0  # chunks exchanged: one flag wait each
        self.pools: PoolPeers | None = None  # every rank's staging pool, once shared (share_pool)
        self.copied_bytes = 0  # shard bytes this rank copied into its chunk buffers for all-gathers
        self.direct_bytes = 0  # shard bytes of this rank's pool the other ranks gathered from it, with no copy in
        self._counted: dict[str, int] = {}  # the counts at the last take_counts
        self.state = TransportState.OPEN

    @property
    def segment_bytes(self) -> int:
        """The shared memory this rank maps: every rank's segment (each is touched by every rank that reads it)."""
        return sum(len(m) for m in self._maps)

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """{tier: {"shared_memory": bytes}} while open, in the form of ``ZeroInfinityEngine.resident_bytes``."""
        if not self.is_open:
            return {}
        return {tier_of(self._segments[self.rank]): {"shared_memory": self.segment_bytes}}

    def take_counts(self) -> dict[str, int]:
        """Since the last call (a step report's counts): ``shared_memory_meetings`` (flag waits), and the all-gathers'
        shard bytes this rank copied into its chunk buffers (``transport_copied_bytes``) or the other ranks took from
        its pool ([Note: gathering from the ranks' pools]: ``pool_gathered_bytes``)."""
        now = {"shared_memory_meetings": self.ops, "transport_copied_bytes": self.copied_bytes,
               "pool_gathered_bytes": self.direct_bytes}
        out = {k: v - self._counted.get(k, 0) for k, v in now.items()}
        self._counted = now
        return out

    @property
    def is_open(self) -> bool:
        return self.state is TransportState.OPEN

    @classmethod
    def connect(cls, comm: Comm, timeout_s: float = 0.0, wanted: bool = True) -> "SameHostTransport | None":
        """Every rank of ``comm`` calls this together. None (on every rank alike) where not ``wanted``
        (``overlap.shared_memory: off``), with one rank, a backend other than gloo, a compute device other than the
        CPU, ranks not all on this host, no writable ``/dev/shm``, or no C++ extension. A collective waits
        ``timeout_s`` for the other ranks where it is > 0 (``collective_timeout_s``), else the process group's own
        timeout."""
        if not wanted or comm.world == 1 or "gloo" not in comm.backend or comm.device.type != "cpu":
            return None
        rank, world, all_gather_object = comm.rank, comm.world, comm.all_gather_object
        ids = all_gather_object((_host_id(), uuid.uuid4().hex, os.getpid()))
        first = ids[0][0]
        if not all(i == first and i.shm_dir and i.native and i.pid_ns for i, _, _ in ids):
            return None
        token, pids = ids[0][1], [pid for _, _, pid in ids]
        maps = map_segments(all_gather_object, rank, [_HEADER + 2 * CHUNK_BYTES] * world, f"zinf-shm-{token}")
        if isinstance(maps, str):
            log.warning("zinf: shared memory between the ranks of this host could not be set up (%s); the "
                        "collectives go through the process group", maps)
            return None
        return cls(rank, world, maps, timeout_s if timeout_s > 0 else _group_timeout_s(comm.group), token, pids)

    def share_pool(self, comm: Comm, nbytes: int) -> "mmap.mmap | None":
        """Every rank calls this together, when its placement builds its staging pool of ``nbytes``: a segment of
        shared memory for the pool, mapped by this rank and open to the others (see [Note: gathering from the ranks'
        pools] in
        zinf/runtime/shared_pool.py). This rank's map, to build the pool over; None (every rank alike) where the
        segments could not be made: the pool is then private and gathers go through the chunk buffers."""
        self._check_open()
        sizes = comm.all_gather_object(int(nbytes))
        maps = map_segments(comm.all_gather_object, self.rank, sizes, f"zinf-pool-{self.token}", peers_mapped=False)
        if isinstance(maps, str):
            log.warning("zinf: the staging pools could not be shared between the ranks of this host (%s); their "
                        "shards are gathered through the chunk buffers", maps)
            return None
        self.pools = PoolPeers(maps, self.rank)
        torch.frombuffer(maps[self.rank], dtype=torch.uint8).fill_(0)  # its pages in this process now, as counted
        return maps[self.rank]

    def close(self) -> None:
        """Unmap the segments, marking this rank's closed first: a rank that still waits for it fails at once."""
        if self.state is TransportState.CLOSED:
            return
        native_shm.mark_closed(self._closed[self.rank], self._flags[self.rank])
        if self.pools is not None:
            self.pools.close()
            self.pools = None
        self._segments.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
        self.state = TransportState.CLOSED

    # -- the collectives --------------------------------------------------------------------------------------

    def all_gather(self, outs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> None:
        """Every ``outs[i]`` (world * shards[i].numel() elements, contiguous) receives every rank's ``shards[i]``,
        rank-major; every rank passes the same sizes in the same order. An ``outs[i]`` of a wider dtype than its
        shard (fp32 from bf16) receives the values widened, in the one copy out of the shared buffers (see [Note: a
        widening gather])."""
        self._check_open()
        # from the pools only where the chunks would meet more than once: the sizes, so the choice, are every rank's
        total = sum(s.numel() * s.element_size() for s in shards)
        direct = self._direct(shards) if self.pools is not None and total > POOL_GATHER_MIN_BYTES else {}
        # (out rows, shard, start, bytes, at)
        pending: list[tuple[torch.Tensor | _Widened, torch.Tensor, int, int, int]] = []
        used = 0
        for i, (out, shard) in enumerate(zip(outs, shards)):
            if i in direct:
                continue
            src = _bytes(shard)
            rows = self._rows(out, shard)
            self.copied_bytes += src.numel()
            start = 0
            while start < src.numel():
                if used >= CHUNK_BYTES:
                    self._gather_chunk(pending)
                    pending, used = [], 0
                n = min(src.numel() - start, CHUNK_BYTES - used)
                pending.append((rows, src, start, n, used))
                used += -(-n // _ALIGN) * _ALIGN
                start += n
        if pending:
            self._gather_chunk(pending)
        if direct:
            self._gather_direct(outs, shards, direct)

    def _rows(self, out: torch.Tensor, shard: torch.Tensor) -> "torch.Tensor | _Widened":
        """``out`` as one row a rank: of bytes, or of elements widened from the shard's dtype."""
        if out.dtype != shard.dtype:  # rows of elements: byte ranges of the shard are read as its dtype
            return _Widened(out.reshape(self.world, shard.numel()), shard.dtype)
        return _bytes(out).view(self.world, shard.numel() * shard.element_size())

    def _direct(self, shards: Sequence[torch.Tensor]) -> dict[int, list[int]]:
        """The first meeting of [Note: gathering from the ranks' pools]: {index of a shard that lies in every rank's
        pool: its offset in each rank's pool}."""
        assert self.pools is not None
        offsets = [self.pools.offset_of(s) if i < TABLE_ENTRIES else -1 for i, s in enumerate(shards)]
        write_table(self._segments[self.rank], offsets)
        self._exchange()
        tables = [offsets if r == self.rank else read_table(self._segments[r]) for r in range(self.world)]
        self._advance()
        return {i: [t[i] for t in tables] for i in range(len(shards)) if all(t[i] >= 0 for t in tables)}

    def _gather_direct(self, outs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor],
                       direct: dict[int, list[int]]) -> None:
        """The copies out of every rank's pool, then the second meeting: every rank is done with every pool."""
        assert self.pools is not None
        for i, at in direct.items():
            out, shard = outs[i], shards[i]
            rows, nbytes = self._rows(out, shard), shard.numel() * shard.element_size()
            for r in range(self.world):
                if r == self.rank:
                    if isinstance(rows, _Widened):
                        rows.write(r, 0, _bytes(shard))
                    elif rows[r].data_ptr() != shard.data_ptr():
                        rows[r].copy_(_bytes(shard))
                elif isinstance(rows, _Widened):
                    for start, raw in self.pools.read_in_pieces(r, at[r], nbytes):
                        rows.write(r, start, raw)
                else:
                    self.pools.read_into(r, at[r], rows[r])
            self.direct_bytes += nbytes
        self._exchange()
        self._advance()

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (n elements) receives this rank's slice of the element-wise sum of every rank's ``full``
        (world * n elements, contiguous), summed in rank order."""
        self._check_open()
        n = out.numel()
        rows = full.reshape(self.world, n)
        flat_out = out.view(-1)
        per_chunk = max(1, CHUNK_BYTES // (self.world * full.element_size()))
        for a in range(0, n, per_chunk):
            b = min(n, a + per_chunk)
            mine = self._slices(self.rank, full.dtype, b - a)
            for r in range(self.world):
                if r != self.rank:
                    mine[r].copy_(rows[r, a:b])
            self._exchange()
            parts = [rows[self.rank, a:b] if r == self.rank else self._slices(r, full.dtype, b - a)[self.rank]
                     for r in range(self.world)]
            torch.add(parts[0], parts[1], out=flat_out[a:b])
            for part in parts[2:]:
                flat_out[a:b].add_(part)
            self._advance()

    # -- internals ----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self.is_open:
            raise ZinfError("zinf: the shared-memory transport was closed (the engine was closed); build a new engine")

    def _buffer(self, r: int) -> torch.Tensor:
        """Rank r's data buffer for the current chunk (the two alternate)."""
        start = _HEADER + (self._seq % 2) * CHUNK_BYTES
        return self._segments[r][start : start + CHUNK_BYTES]

    def _slices(self, r: int, dtype: torch.dtype, width: int) -> torch.Tensor:
        """Rank r's buffer as a reduce-scatter chunk: one row of ``width`` elements for each rank."""
        return self._buffer(r).view(dtype)[: self.world * width].view(self.world, width)

    def _gather_chunk(self, pending: list[tuple[torch.Tensor, torch.Tensor, int, int, int]]) -> None:
        mine = self._buffer(self.rank)
        for _, src, start, n, at in pending:
            mine[at : at + n].copy_(src[start : start + n])
        self._exchange()
        for r in range(self.world):
            buf = self._buffer(r)
            for rows, src, start, n, at in pending:
                if isinstance(rows, _Widened):
                    rows.write(r, start, buf[at : at + n] if r != self.rank else src[start : start + n])
                    continue
                dst = rows[r, start : start + n]
                if r != self.rank:
                    dst.copy_(buf[at : at + n])
                elif dst.data_ptr() != src.data_ptr():
                    dst.copy_(src[start : start + n])
        self._advance()

    def _exchange(self) -> None:
        """Post this rank's chunk and wait for every other rank's."""
        seq = self._seq + 1
        native_shm.post(self._flags[self.rank], seq)
        peers = [r for r in range(self.world) if r != self.rank]
        outcome, at = native_shm.wait_all([self._flags[r] for r in peers], [self._closed[r] for r in peers],
                                          [self._pids[r] for r in peers], seq, self.timeout_s, self._spins)
        if outcome is native_shm.Outcome.CLOSED:
            raise ZinfError(
                f"zinf: rank {peers[at]} closed its shared-memory transport (its engine was closed, by the script or "
                f"on an error of its own that its log shows) while this rank waited for it in a shared-memory "
                f"collective (chunk {seq}), so it will never take part. Close the engine on every rank at the same "
                f"point (after the same step), or set overlap.shared_memory: off to use the process group")
        if outcome is native_shm.Outcome.EXITED:
            gone = peers[at]
            raise ZinfError(f"zinf: rank {gone} (pid {self._pids[gone]}) exited while this rank waited for it in a "
                            f"shared-memory collective (chunk {seq}); its own log says why")
        if outcome is native_shm.Outcome.TIMED_OUT:
            raise SharedMemoryTimeout(
                f"zinf: timed out after {self.timeout_s:g} s waiting for rank {peers[at]} in a shared-memory "
                f"collective (chunk {seq}); that rank stopped, died or runs other collectives. Raise "
                f"collective_timeout_s if it is only slow, or set overlap.shared_memory: off to use the process group")
        self.ops += 1

    def _advance(self) -> None:
        self._seq += 1


class _Widened:
    """[Note: a widening gather]
    A group stored narrower than it computes (bf16 shards, fp32 compute: ``param_storage``) used to be gathered into a
    buffer of shards and widened from there into its full buffer: the gathered bytes written once more and read once
    more. Through shared memory the copy out of each rank's buffer writes the full buffer's rows directly, widening as
    it copies: the same values (widening is exact), one pass fewer over them. A chunk's byte range of a shard always
    holds whole elements: chunks are cut at 64-byte boundaries of a shard's bytes."""

    __slots__ = ("rows", "dtype")

    def __init__(self, rows: torch.Tensor, dtype: torch.dtype) -> None:
        self.rows, self.dtype = rows, dtype

    def write(self, r: int, start: int, raw: torch.Tensor) -> None:
        """Rank r's shard bytes ``raw``, from byte ``start`` of the shard, into its row, widened."""
        first = start // self.dtype.itemsize
        widen_into(self.rows[r, first : first + raw.numel() // self.dtype.itemsize], raw.view(self.dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("zinf: a shared-memory collective needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8)
