"""Where a group's compute-dtype parameter shard lives between uses: device, CPU or NVMe.

Chosen once per engine (``offload.params``); groups only call ``fetch`` / ``done`` around their
all-gather and ``writer`` / ``commit`` after an optimizer step. The NVMe store reads each rank's own
shard (bandwidth-centric: every rank reads 1/world, then all-gather) into a buffer of the pinned
pool, ahead of use when the trace asks for it (``prefetch``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from zinf.offload.swap import Record, SwapSpace

if TYPE_CHECKING:
    from zinf.native import PinnedBufferPool
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["ParamStore", "DeviceParamStore", "CpuParamStore", "NvmeParamStore"]


ACQUIRE_TIMEOUT_S = 120.0


def acquire_waiting(pool: "PinnedBufferPool", nbytes: int, make_room: Callable[[], bool] | None) -> torch.Tensor:
    """A pool buffer for work that must not fail for room (the optimizer pipeline, an updated shard).
    The pool keeps a reserve for it, but buddy fragmentation can still leave no block of the size:
    then parameter read-ahead is given up (``make_room``), or buffers held by gathers in flight are
    waited for, for at most ``ACQUIRE_TIMEOUT_S``. Never call it holding a lock those gathers need."""
    from zinf.native import PoolExhaustedError

    deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
    while True:
        try:
            return pool.acquire(nbytes)
        except PoolExhaustedError:
            if time.monotonic() > deadline:
                raise
            if make_room is None or not make_room():
                time.sleep(0.002)


class ParamStore:
    """Base and device tier: the shard stays where compute runs."""

    tier = "device"

    def attach(self, group: "FlatParamGroup") -> None:
        group.param_store = self

    def prefetch(self, group: "FlatParamGroup") -> bool:
        return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def done(self, group: "FlatParamGroup") -> None:
        return None

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        """A compute-dtype tensor of ``shard_numel`` to write the updated shard into."""
        assert group.shard is not None
        return group.shard

    def commit(self, group: "FlatParamGroup") -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


DeviceParamStore = ParamStore


class CpuParamStore(ParamStore):
    """Shards in (pinned, with CUDA) host memory, copied to the device for each gather."""

    tier = "cpu"

    def attach(self, group: "FlatParamGroup") -> None:
        super().attach(group)
        assert group.shard is not None
        if group.shard.device.type != "cpu":  # pragma: no cover - CUDA only
            host = torch.empty(group.shard.shape, dtype=group.shard.dtype, pin_memory=True)
            host.copy_(group.shard)
            group.shard = host

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        assert group.shard is not None
        return group.shard.to(group.device, non_blocking=True)


class NvmeParamStore(ParamStore):
    """Shards in this rank's swap files; see [Note: offload file format] in swap.py."""

    tier = "nvme"

    def __init__(self, swap: SwapSpace, pool: "PinnedBufferPool") -> None:
        self.swap, self.pool = swap, pool
        self.records: dict[int, Record] = {}
        self._reads: dict[int, tuple[torch.Tensor, int]] = {}
        self._staged: dict[int, torch.Tensor] = {}
        self._writes: dict[int, tuple[torch.Tensor, int]] = {}
        # the background optimizer step (writer/commit) and the training thread (prefetch/fetch/done)
        # share these tables; see [Note: background step] in optimizer.py
        self._lock = threading.RLock()
        self._fetched: set[int] = set()  # reads handed to a gather: their buffers are in use until done()
        self.reserve_bytes = 0  # pool bytes read-ahead must leave free (the offloaded optimizer's pipeline)

    def attach(self, group: "FlatParamGroup") -> None:
        super().attach(group)
        self.records[id(group)] = self.swap.allocate(group.shard_numel * group.compute_dtype.itemsize)

    def write_initial(self, group: "FlatParamGroup") -> None:
        """After ``swap.open()``: the resident shard goes to its file and its memory is freed."""
        assert group.shard is not None
        self.writer(group).copy_(group.shard)
        self.commit(group)
        self._finish_write(id(group))
        group.shard = None

    def _buffer(self, rec: Record) -> torch.Tensor:
        return self.pool.acquire(rec.span)

    def _data(self, group: "FlatParamGroup", buf: torch.Tensor) -> torch.Tensor:
        nbytes = self.records[id(group)].nbytes
        return buf[:nbytes].view(group.compute_dtype)

    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        """Start reading ``group``'s shard; False when the pool has no room. Read-ahead (not ``demand``)
        is bounded by the pool less ``reserve_bytes``, which the offloaded optimizer's pipeline needs."""
        from zinf.native import PoolExhaustedError

        key = id(group)
        if group.await_update is not None and not demand:
            return True  # its new shard is still being computed: read it when it is needed
        with self._lock:
            if key in self._reads:
                return True
            if key in self._writes:  # a read must see the last write
                self._finish_write(key)
            rec = self.records[key]
            if not demand and self.pool.capacity_bytes - self.pool.bytes_in_use < self.reserve_bytes + 2 * rec.span:
                return False
            try:
                buf = self._buffer(rec)
            except PoolExhaustedError:
                return False
            self._reads[key] = (buf, self.swap.submit_read(rec, buf))
            return True

    def make_room(self) -> bool:
        """Give up the most recent read-ahead (it is read again when needed); False if there is none."""
        with self._lock:
            spare = [k for k in self._reads if k not in self._fetched]
            if not spare:
                return False
            key = spare[-1]
            buf, handle = self._reads.pop(key)
            self.swap.wait(handle, self.records[key])
            self.pool.release(buf)
            return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        while not self.prefetch(group, demand=True):
            if not self.make_room():
                raise MemoryError(f"zinf offload: the pinned pool cannot stage {group.name}; raise offload.pinned_pool_bytes")
        with self._lock:
            buf, handle = self._reads[id(group)]
            rec = self.records[id(group)]
            self.swap.wait(handle, rec)
            self.swap.verify(rec, buf)
            self._fetched.add(id(group))
            return self._data(group, buf).to(group.device, non_blocking=True)

    def done(self, group: "FlatParamGroup") -> None:
        with self._lock:
            self._fetched.discard(id(group))
            buf, _ = self._reads.pop(id(group))
            self.pool.release(buf)

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        key = id(group)
        with self._lock:
            if key in self._writes:
                self._finish_write(key)
            if key in self._staged:
                return self._data(group, self._staged[key])
        buf = acquire_waiting(self.pool, self.records[key].span, self.make_room)  # not under the lock: done() frees room
        with self._lock:
            self._staged[key] = buf
            return self._data(group, buf)

    def commit(self, group: "FlatParamGroup") -> None:
        """Start writing the staged shard; the writes before it are finished now, so at most one write
        holds a pool buffer while the next shard is staged (pending writes never fill the pool)."""
        key = id(group)
        with self._lock:
            buf = self._staged.pop(key)
            older = [k for k in self._writes if k != key]
            self._writes[key] = (buf, self.swap.submit_write(self.records[key], buf))
            for k in older:
                self._finish_write(k)

    def _finish_write(self, key: int) -> None:
        buf, handle = self._writes.pop(key)
        self.swap.wait(handle, self.records[key])
        self.pool.release(buf)

    def flush(self) -> None:
        with self._lock:
            for key in list(self._writes):
                self._finish_write(key)

    def close(self) -> None:
        self.flush()
        with self._lock:
            for key, (buf, handle) in self._reads.items():
                self.swap.wait(handle, self.records[key])
                self.pool.release(buf)
            self._reads.clear()
