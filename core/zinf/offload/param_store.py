"""The host and NVMe tiers of the parameter-shard store (the protocol and the device tier: zinf/param/store.py).

Chosen once per engine (``offload.params``) and built complete by the placement. The NVMe store reads
each rank's own shard (bandwidth-centric: every rank reads 1/world, then all-gather) into a buffer of the
pinned pool, ahead of use when the trace asks for it (``prefetch``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from zinf.native import PoolExhaustedError
from zinf.offload.pool_room import ACQUIRE_TIMEOUT_S, PARAMS, PoolRoom
from zinf.offload.swap import Record, SwapSpace

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["CpuShardStore", "NvmeShardStore"]


class CpuShardStore:
    """Shards in (pinned, with CUDA) host memory, copied to the device for each gather."""

    tier = "cpu"

    def __init__(self, groups: Sequence["FlatParamGroup"]) -> None:
        self._shards: dict[int, torch.Tensor] = {}
        for g in groups:
            shard = g.hand_over_shard()
            if shard.device.type != "cpu":  # pragma: no cover - CUDA only
                host = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
                host.copy_(shard)
                shard = host
            self._shards[id(g)] = shard

    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        return self._shards[id(group)].to(group.device, non_blocking=True)

    def done(self, group: "FlatParamGroup") -> None:
        return None

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        return self._shards[id(group)]

    def commit(self, group: "FlatParamGroup") -> None:
        return None

    def keep_for_backward(self, keep: bool) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def bytes_by_tier(self) -> dict[str, int]:
        return {"cpu": sum(t.untyped_storage().nbytes() for t in self._shards.values())}


@dataclass(eq=False)
class _Slot:
    """One group's shard in a pool buffer of the NVMe store. See [Note: NVMe parameter slots]."""

    buf: torch.Tensor
    read: int | None = None  # a read of the file into ``buf`` is in flight
    write: int | None = None  # a write of ``buf`` to the file is in flight
    in_use: bool = False  # handed to a gather: fetch() .. done()
    staged: bool = False  # the optimizer is writing the updated shard into it: writer() .. commit()
    consumed: bool = False  # gathered and not kept: release it once its write has finished
    used: int = 0  # when its last gather finished (the store's counter); 0: not gathered since it was filled

    @property
    def idle(self) -> bool:
        return not (self.in_use or self.staged)


class NvmeShardStore:
    """Shards in this rank's swap files; see [Note: offload file format] in swap.py.

    [Note: NVMe parameter slots]
    A group has at most one slot: a pool buffer that is either being read (read-ahead), holds the shard
    (read, or staged by the optimizer and committed), or is being filled by the optimizer. An updated
    shard is written back and *kept* in its slot, so the next forward gathers it from memory instead of
    reading back what was just written. After a gather in a training forward (``keep_gathered``) the
    slot stays while the pool has room beyond ``reserve_bytes`` (the backward then gathers the same
    shard without a read); otherwise it is released once its write has finished. Idle slots are a
    cache that ``evict_one`` thins when the pool is short: first slots only waiting for their write,
    then gathered ones, least recently used first (the forward's first modules are the backward's
    last), then the ones not gathered yet, most recently filled first (the forward reaches them last);
    ``flush`` empties it. Writes never block the optimizer: finished ones are collected (``_reap``)
    whenever the store is called, or waited for when their buffer is needed.
    """

    tier = "nvme"

    def __init__(self, groups: Sequence["FlatParamGroup"], swap: SwapSpace, room: PoolRoom, reserve_bytes: int) -> None:
        self.swap, self.room, self.pool = swap, room, room.pool
        self.records: dict[int, Record] = {
            id(g): swap.allocate(g.shard_numel * g.compute_dtype.itemsize) for g in groups}
        self._slots: dict[int, _Slot] = {}  # insertion order: the most recently filled last
        # the background optimizer step (writer/commit) and the training thread (prefetch/fetch/done)
        # share the slots; see [Note: background step] in zinf/optim/offloaded.py
        self._lock = threading.RLock()
        self.reserve_bytes = reserve_bytes  # pool bytes read-ahead and kept slots leave free (a demand read, a staged update)
        self._clock = 0  # counts finished gathers, for the least-recently-used order of kept slots
        # True during a training forward, whose shards its backward gathers again
        self.keep_gathered = False
        room.add_evictor(PARAMS, self.evict_one)

    def keep_for_backward(self, keep: bool) -> None:
        self.keep_gathered = keep

    def write_initial(self, group: "FlatParamGroup") -> None:
        """After ``swap.open()``: the shard the group was built with goes to its file and its memory is freed."""
        shard = group.hand_over_shard()
        self.writer(group).copy_(shard)
        self.commit(group)
        with self._lock:
            self._drop(id(group))

    def bytes_by_tier(self) -> dict[str, int]:
        return {"nvme": sum(r.span for r in self.records.values())}

    def _data(self, group: "FlatParamGroup", buf: torch.Tensor) -> torch.Tensor:
        nbytes = self.records[id(group)].nbytes
        return buf[:nbytes].view(group.compute_dtype)

    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        """Start reading ``group``'s shard; False when the pool has no room. Read-ahead (not ``demand``)
        is bounded by the pool less ``reserve_bytes``; the optimizer evicts it when it needs the room."""
        key = id(group)
        if group.update_pending and not demand:
            return True  # its new shard is still being computed: it will be in its slot when needed
        with self._lock:
            self._reap()
            if key in self._slots:
                return True
            rec = self.records[key]
            if not demand and self.pool.capacity_bytes - self.pool.bytes_in_use < self.reserve_bytes + 2 * rec.span:
                return False
            try:
                buf = self.pool.acquire(rec.span)
            except PoolExhaustedError:
                return False
            self._slots[key] = _Slot(buf, read=self.swap.submit_read(rec, buf))
            return True

    def evict_one(self) -> bool:
        """Free one idle slot, the one needed last (read-ahead or kept updates, most recent first; a
        consumed one before all); False if there is none."""
        with self._lock:
            idle = [(k, s) for k, s in self._slots.items() if s.idle]
            if not idle:
                return False
            consumed = [k for k, s in idle if s.consumed]
            gathered = sorted((s.used, k) for k, s in idle if s.used)
            self._drop(consumed[0] if consumed else gathered[0][1] if gathered else idle[-1][0])
            return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
        while not self.prefetch(group, demand=True):
            if self.room.make_room():
                continue
            if time.monotonic() > deadline:  # nothing came free: the optimizer step holds the rest
                raise MemoryError(f"zinf offload: the pinned pool cannot stage {group.name}; raise offload.pinned_pool_bytes")
            time.sleep(0.002)
        with self._lock:
            slot, rec = self._slots[id(group)], self.records[id(group)]
            assert not slot.staged, f"{group.name}: gathered while its update is being staged"
            if slot.read is not None:
                self.swap.wait(slot.read, rec)
                slot.read = None
                self.swap.verify(rec, slot.buf)
            slot.in_use, slot.consumed = True, False
            return self._data(group, slot.buf).to(group.device, non_blocking=True)

    def done(self, group: "FlatParamGroup") -> None:
        with self._lock:
            key = id(group)
            slot = self._slots[key]
            self._clock += 1
            slot.in_use, slot.used = False, self._clock
            if self.keep_gathered and self.pool.capacity_bytes - self.pool.bytes_in_use >= self.reserve_bytes:
                return
            slot.consumed = True  # not needed again soon, or no room to keep it
            if slot.write is None:
                self._drop(key)
        if not self.keep_gathered:
            self.room.room_given_back()

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        key = id(group)
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.staged:  # the next sub-group of the same update
                return self._data(group, slot.buf)
            if slot is not None:
                assert slot.idle, f"{group.name}: its shard is updated while a gather uses it"
                self._settle(key, slot)
                self._slots[key] = self._slots.pop(key)  # most recently filled: last
                slot.staged, slot.consumed, slot.used = True, False, 0
                return self._data(group, slot.buf)
        buf = self.room.acquire_waiting(self.records[key].span)  # not under the lock: done() frees room
        with self._lock:
            self._slots[key] = _Slot(buf, staged=True)
            return self._data(group, buf)

    def commit(self, group: "FlatParamGroup") -> None:
        """Start writing the staged shard; it stays in its slot for the next gather."""
        key = id(group)
        with self._lock:
            slot = self._slots[key]
            assert slot.staged and slot.write is None
            slot.staged = False
            slot.write = self.swap.submit_write(self.records[key], slot.buf)
            self._reap()

    def _settle(self, key: int, slot: _Slot) -> None:
        """Finish the I/O in flight on ``slot``."""
        rec = self.records[key]
        if slot.read is not None:
            self.swap.wait(slot.read, rec)
            slot.read = None
            self.swap.verify(rec, slot.buf)
        if slot.write is not None:
            self.swap.wait(slot.write, rec)
            slot.write = None

    def _drop(self, key: int) -> None:
        slot = self._slots.pop(key)
        assert slot.idle
        self._settle(key, slot)
        self.pool.release(slot.buf)

    def _reap(self) -> None:
        """Collect finished writes, releasing the slots that were only waiting for them."""
        for key, slot in list(self._slots.items()):
            if slot.write is not None and self.swap.aio.done(slot.write):
                self.swap.wait(slot.write, self.records[key])
                slot.write = None
                if slot.consumed and slot.idle:
                    self._drop(key)

    def flush(self) -> None:
        """Finish every write and empty the cache: afterwards the files alone hold the shards."""
        with self._lock:
            for key in [k for k, s in self._slots.items() if s.idle]:
                self._drop(key)

    def close(self) -> None:
        self.flush()
