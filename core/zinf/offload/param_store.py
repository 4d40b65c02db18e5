"""The host and NVMe tiers of the parameter-shard store (the protocol and the device tier: zinf/param/store.py).

Chosen once per engine (``offload.params``) and built complete by the placement. The NVMe store reads
each rank's own shard (bandwidth-centric: every rank reads 1/world, then all-gather) into a buffer of the
pinned pool, ahead of use when the trace asks for it (``prefetch``).
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from zinf.runtime.staging import device_is_apart, host_empty, mark_device
from zinf.runtime.streams import BufferFence, region, streams_for
from zinf.native import PoolExhaustedError
from zinf.offload.pool_room import ACQUIRE_TIMEOUT_S, PARAMS, PoolRoom
from zinf.offload.in_place import InPlaceRecord
from zinf.offload.swap import Record, SwapSpace
from zinf.param.store import DeviceShardStore

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["CpuShardStore", "NvmeShardStore", "SlotState"]


def _copy_in(group: "FlatParamGroup", host: torch.Tensor) -> tuple[torch.Tensor, BufferFence]:
    """``host`` (a pinned shard) on ``group``'s device, copied on the copy_in stream, and the fence that gates
    the reuse of ``host``; the all_gather stream is made to wait for the copy. See [Note: streams] in
    zinf/runtime/streams.py. With CPU compute ``host`` is the shard itself (no copy), and the fence a no-op, unless
    the device stands apart (see [Note: staged device] in zinf/runtime/staging.py)."""
    streams = streams_for(group.device)
    if not device_is_apart(group.device):
        shard = host
    else:
        shard = torch.empty(host.shape, dtype=host.dtype, device=group.device)  # on compute: the stream that frees it
        mark_device(shard)
        with region("h2d", group.name):
            streams.copy_in.wait_stream(streams.current())  # its block may be memory compute has just freed
            with streams.use(streams.copy_in):
                shard.copy_(host, non_blocking=True)
    fence = streams.record(streams.copy_in)
    fence.make_wait(streams.all_gather)
    return shard, fence


class CpuShardStore(DeviceShardStore):
    """Shards in (pinned, with CUDA) host memory, copied to the device for each gather (on the copy_in
    stream; a shard is rewritten by the optimizer only once its last copy has read it). No I/O: prefetch,
    done, commit, keep_for_backward, flush and close are the device tier's no-ops."""

    tier = "cpu"

    def __init__(self, groups: Sequence["FlatParamGroup"]) -> None:
        self._shards: dict[int, torch.Tensor] = {}
        self._fences: dict[int, BufferFence] = {}  # the last copy-in of each shard
        self._groups = list(groups)
        for g in groups:
            shard = g.hand_over_shard()
            if device_is_apart(g.device):  # pinned with CUDA
                host = host_empty(shard.shape, shard.dtype, g.device)
                host.copy_(shard)
                shard = host
            self._shards[id(g)] = shard

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        shard, self._fences[id(group)] = _copy_in(group, self._shards[id(group)])
        return shard

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        return self._shards[id(group)]

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        fence = self._fences.pop(id(group), None)
        if fence is not None:
            fence.wait()  # the host overwrites the shard: its copy to the device must have read it
        return self._shards[id(group)]

    def bytes_by_tier(self) -> dict[str, int]:
        """Shards that are not their group's master as well (fp32 on a CPU device with a device-tier optimizer: one
        tensor, counted once, as the master)."""
        total = 0
        for g in self._groups:
            shard = self._shards[id(g)]
            if g.master is None or g.master.data_ptr() != shard.data_ptr():
                total += shard.untyped_storage().nbytes()
        return {"cpu": total}


class SlotState(enum.Enum):
    """Who uses an NVMe slot's buffer and what it holds; see [Note: NVMe parameter slots]. Apart from the
    state, a write of the buffer to its file (``_Slot.write``) may be in flight in FILLED, IN_USE, KEPT and
    CONSUMED (it only reads the buffer, as a gather's copy does)."""

    READING = "reading"  # the file is being read into it (read-ahead, or a demand read); not gathered yet
    FILLED = "filled"  # holds the shard, not gathered since it was filled (read, or staged and committed)
    IN_USE = "in_use"  # handed to a gather: fetch() .. done()
    KEPT = "kept"  # gathered, and kept for the next gather (the backward's)
    CONSUMED = "consumed"  # gathered and not kept: released once its write (if any) has finished
    STAGED = "staged"  # the optimizer is writing the updated shard into it: writer() .. commit()


_HANDED = (SlotState.FILLED, SlotState.KEPT, SlotState.CONSUMED, SlotState.IN_USE)


class _Slot:
    """One group's shard in a pool buffer of the NVMe store: its state, the I/O in flight on the buffer and
    the fence of the buffer's last copy to the device. The store does the I/O and the pool; every change of
    a slot is one of the verbs below. See [Note: NVMe parameter slots]."""

    __slots__ = ("buf", "state", "read", "write", "used", "_copied")

    def __init__(self, buf: torch.Tensor, state: SlotState, read: int | None = None) -> None:
        assert (state is SlotState.READING) == (read is not None)
        self.buf = buf
        self.state = state
        self.read = read  # the read of the file into ``buf`` in flight (READING)
        self.write: int | None = None  # a write of ``buf`` to the file is in flight
        self.used = 0  # when its last gather finished (the store's counter); 0: not gathered since it was filled
        self._copied: BufferFence | None = None  # the last copy of ``buf`` to the device (a gather's source)

    @classmethod
    def reading(cls, buf: torch.Tensor, handle: int) -> "_Slot":
        """A buffer the file is being read into (``handle``)."""
        return cls(buf, SlotState.READING, handle)

    @classmethod
    def staging(cls, buf: torch.Tensor) -> "_Slot":
        """A new buffer for the optimizer to write an updated shard into."""
        return cls(buf, SlotState.STAGED)

    @property
    def idle(self) -> bool:
        """Neither a gather nor the optimizer has it: it may be evicted, flushed or staged."""
        return self.state is not SlotState.IN_USE and self.state is not SlotState.STAGED

    @property
    def staged(self) -> bool:
        return self.state is SlotState.STAGED

    def read_done(self) -> None:
        """Its read has been waited for: READING -> FILLED (the store verifies the trailer next)."""
        assert self.state is SlotState.READING, f"read_done from {self.state}"
        self.state, self.read = SlotState.FILLED, None

    def hand_to_gather(self, copied: BufferFence) -> None:
        """A gather copies the buffer to the device (``copied``: that copy's fence) -> IN_USE. The previous copy's
        fence is replaced: copies run in order on the copy_in stream, so the new fence covers the old one too.
        From IN_USE only when a gather is started again after one that failed before its ``done``."""
        assert self.state in _HANDED, f"hand_to_gather from {self.state}"
        self.state, self._copied = SlotState.IN_USE, copied

    def give_back(self, clock: int, keep: bool) -> None:
        """Its gather finished at ``clock``: IN_USE -> KEPT (``keep``: gathered again soon) or CONSUMED."""
        assert self.state is SlotState.IN_USE, f"give_back from {self.state}"
        self.state, self.used = (SlotState.KEPT if keep else SlotState.CONSUMED), clock

    def stage(self) -> None:
        """The optimizer writes the updated shard into the buffer (an idle slot whose I/O the store settled)
        -> STAGED, as newly filled. Waits for the last device copy to have read the buffer."""
        assert self.idle and self.read is None and self.write is None, f"stage from {self.state}"
        self._wait_copied()
        self.state, self.used = SlotState.STAGED, 0

    def commit(self) -> None:
        """The staged shard is complete: STAGED -> FILLED (the store starts its write next)."""
        assert self.state is SlotState.STAGED and self.write is None, f"commit from {self.state}"
        self.state = SlotState.FILLED

    def start_write(self, handle: int) -> None:
        """A write of the buffer to the file is in flight (``handle``); the buffer is only read by it."""
        assert self.write is None and self.state is not SlotState.READING and self.state is not SlotState.STAGED
        self.write = handle

    def write_done(self) -> None:
        """Its write has been waited for."""
        assert self.write is not None
        self.write = None

    def release(self) -> torch.Tensor:
        """The buffer, to go back to the pool: the slot is idle and its I/O settled. Waits for the last
        device copy to have read it (the pool hands it to the next read at once)."""
        assert self.idle and self.read is None and self.write is None, f"release from {self.state}"
        self._wait_copied()
        return self.buf

    def _wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.wait()
            self._copied = None

    def __repr__(self) -> str:
        io = " reading" if self.read is not None else " writing" if self.write is not None else ""
        return f"_Slot({self.state.name}{io}, used={self.used})"


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

    A slot's state (:class:`SlotState`): READING -> FILLED when its read is waited for; FILLED, KEPT or
    CONSUMED -> IN_USE in ``fetch``; IN_USE -> KEPT or CONSUMED in ``done``; an idle one -> STAGED in
    ``writer`` (a new slot starts STAGED); STAGED -> FILLED in ``commit``. A write to the file may be in
    flight beside any state but READING and STAGED. ``fetch`` copies the buffer to the device on the copy_in
    stream and keeps that copy's fence on the slot: the buffer goes back to the pool, or is staged again,
    only after the fence is waited for (see [Note: streams] in zinf/runtime/streams.py).
    """

    tier = "nvme"

    def __init__(self, groups: Sequence["FlatParamGroup"], swap: SwapSpace, room: PoolRoom, reserve_bytes: int,
                 in_place: Mapping[int, InPlaceRecord] | None = None) -> None:
        self.swap, self.room, self.pool = swap, room, room.pool
        # frozen groups that keep reading from the checkpoint's files (``in_place``, by group id: see [Note: frozen
        # shards in place] in in_place.py); every other group gets a swap record
        in_place = in_place or {}
        self.records: dict[int, Record | InPlaceRecord] = {
            id(g): in_place.get(id(g)) or swap.allocate(g.shard_numel * g.storage_dtype.itemsize) for g in groups}
        self._names = {id(g): g.name for g in groups}  # for the nvme_read / nvme_write regions
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

    def write_initial(self, group: "FlatParamGroup", deferred: Record | None = None) -> None:
        """After ``swap.open()``: the shard the group was built with goes to its file and its memory is freed.
        ``deferred``: its record, whose room ``open`` left to be reserved once the shard has left its construction
        spill (see [Note: one copy on the drive] in zinf/placement.py)."""
        if isinstance(self.records[id(group)], InPlaceRecord):
            group.hand_over_in_place()  # it stays where it lies: nothing to read or write
            return
        shard = group.hand_over_shard()
        if deferred is not None:
            self.swap.reserve(deferred)
        self.writer(group).copy_(shard)
        self.commit(group)
        with self._lock:
            self._drop(id(group))

    def bytes_by_tier(self) -> dict[str, int]:
        """The swap records' bytes (frozen shards read from checkpoint files: ``in_place_bytes``)."""
        return {"nvme": sum(r.span for r in self.records.values() if isinstance(r, Record))}

    def in_place_bytes(self) -> int:
        """Bytes of this rank's frozen shards read from checkpoint files (see [Note: frozen shards in place])."""
        return sum(r.nbytes for r in self.records.values() if isinstance(r, InPlaceRecord))

    def _data(self, group: "FlatParamGroup", buf: torch.Tensor) -> torch.Tensor:
        nbytes = self.records[id(group)].nbytes
        return buf[:nbytes].view(group.storage_dtype)

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
            with region("nvme_read", group.name):
                handle = self.swap.submit_read(rec, buf)
            self._slots[key] = _Slot.reading(buf, handle)
            return True

    def evict_one(self) -> bool:
        """Free one idle slot, the one needed last (read-ahead or kept updates, most recent first; a
        consumed one before all); False if there is none."""
        with self._lock:
            idle = [(k, s) for k, s in self._slots.items() if s.idle]
            if not idle:
                return False
            consumed = [k for k, s in idle if s.state is SlotState.CONSUMED]
            gathered = sorted((s.used, k) for k, s in idle if s.used)
            self._drop(consumed[0] if consumed else gathered[0][1] if gathered else idle[-1][0])
            return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
        while True:
            # the read is started (or found) and its slot taken under one hold of the lock: in between, the
            # background optimizer step's room-maker could evict the idle slot (seen as a KeyError on one rank,
            # then a collective mismatch, with overlap_optimizer and a pool smaller than the shards)
            with self._lock:
                if self.prefetch(group, demand=True):
                    return self._hand_to_gather(group)
            if self.room.make_room():
                continue
            if time.monotonic() > deadline:  # nothing came free: the optimizer step holds the rest
                raise MemoryError(f"zinf offload: the pinned pool cannot stage {group.name}; raise offload.pinned_pool_bytes")
            time.sleep(0.002)

    def _hand_to_gather(self, group: "FlatParamGroup") -> torch.Tensor:
        """The slot that ``prefetch`` has just made or found, handed to the gather (the caller holds the lock)."""
        key = id(group)
        slot = self._slots[key]
        assert not slot.staged, f"{group.name}: gathered while its update is being staged"
        if slot.read is not None:
            self._finish_read(key, slot)
        # the buffer goes back to the pool (or is staged again) only once this copy has read it
        source, copied = _copy_in(group, self._data(group, slot.buf))
        slot.hand_to_gather(copied)
        return source

    def done(self, group: "FlatParamGroup") -> None:
        with self._lock:
            key = id(group)
            slot = self._slots[key]
            self._clock += 1
            keep = self.keep_gathered and self.pool.capacity_bytes - self.pool.bytes_in_use >= self.reserve_bytes
            slot.give_back(self._clock, keep)  # not kept: not needed again soon, or no room to keep it
            if keep:
                return
            if slot.write is None:
                self._drop(key)
        if not self.keep_gathered:
            self.room.room_given_back()

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        """A copy of the shard: from its slot when it has one (a newer write may still be on its way to the
        file), else read from the file into a pool buffer and checked."""
        key = id(group)
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                assert not slot.staged, f"{group.name}: read while its update is being staged"
                if slot.read is not None:
                    self._finish_read(key, slot)
                return self._data(group, slot.buf).clone()
        # no slot: the file holds the shard (a slot is dropped only once its write has finished)
        rec = self.records[key]
        buf = self.room.acquire_waiting(rec.span)
        try:
            with region("nvme_read", group.name):
                self.swap.wait(self.swap.submit_read(rec, buf), rec)
            self.swap.verify(rec, buf)
            return self._data(group, buf).clone()
        finally:
            self.pool.release(buf)

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        key = id(group)
        if isinstance(self.records[key], InPlaceRecord):  # new values (a load into the engine): a swap record of its own
            self.records[key] = self.swap.allocate_late(self.records[key].nbytes)
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.staged:  # the next sub-group of the same update
                return self._data(group, slot.buf)
            if slot is not None:
                assert slot.idle, f"{group.name}: its shard is updated while a gather uses it"
                self._settle(key, slot)
                self._slots[key] = self._slots.pop(key)  # most recently filled: last
                slot.stage()  # waits for its last copy to the device
                return self._data(group, slot.buf)
        buf = self.room.acquire_waiting(self.records[key].span)  # not under the lock: done() frees room
        with self._lock:
            self._slots[key] = _Slot.staging(buf)
            return self._data(group, buf)

    def commit(self, group: "FlatParamGroup") -> None:
        """Start writing the staged shard; it stays in its slot for the next gather."""
        key = id(group)
        with self._lock:
            slot = self._slots[key]
            slot.commit()
            with region("nvme_write", group.name):
                slot.start_write(self.swap.submit_write(self.records[key], slot.buf))
            self._reap()

    def begin_update(self) -> None:
        return None

    def end_update(self) -> None:
        return None

    def _finish_read(self, key: int, slot: _Slot) -> None:
        """Wait for ``slot``'s read and check what it read."""
        rec = self.records[key]
        assert slot.read is not None
        with region("nvme_read", self._names[key]):
            self.swap.wait(slot.read, rec)
        slot.read_done()
        self.swap.verify(rec, slot.buf)

    def _settle(self, key: int, slot: _Slot) -> None:
        """Finish the I/O in flight on ``slot``."""
        if slot.read is not None:
            self._finish_read(key, slot)
        if slot.write is not None:
            with region("nvme_write", self._names[key]):
                self.swap.wait(slot.write, self.records[key])
            slot.write_done()

    def _drop(self, key: int) -> None:
        slot = self._slots.pop(key)
        assert slot.idle
        self._settle(key, slot)
        self.pool.release(slot.release())  # after its last copy to the device has read it

    def _reap(self) -> None:
        """Collect finished writes, releasing the slots that were only waiting for them."""
        for key, slot in list(self._slots.items()):
            if slot.write is not None and self.swap.aio.done(slot.write):
                self.swap.wait(slot.write, self.records[key])
                slot.write_done()
                if slot.state is SlotState.CONSUMED:  # idle, only waiting for its write
                    self._drop(key)

    def flush(self) -> None:
        """Finish every write and empty the cache: afterwards the files alone hold the shards."""
        with self._lock:
            for key in [k for k, s in self._slots.items() if s.idle]:
                self._drop(key)

    def close(self) -> None:
        self.flush()
