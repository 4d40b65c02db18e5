"""The NVMe tier of the parameter-shard store: each rank's shards in its swap files, read into pinned pool buffers
(its slots) ahead of use and written back after each update.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from zinf.runtime.streams import Streams
from zinf.runtime.logs import region
from zinf.native import PoolExhaustedError
from zinf.offload.pool_room import ACQUIRE_TIMEOUT_S, PARAMS, PoolRoom
from zinf.offload.in_place import InPlaceRecord
from zinf.offload.nvme_slots import Slot, SlotState
from zinf.device_memory import device_is_apart
from zinf.offload.param_store import copy_in
from zinf.offload.swap import Record, SwapSpace
from zinf.native.checksum import ContentCheck

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["NvmeShardStore"]


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
    ``writer`` (a new slot starts STAGED); STAGED -> FILLED in ``commit``; KEPT -> CONSUMED in ``release_kept``. A write to the file may be in
    flight beside any state but READING and STAGED. ``fetch`` copies the buffer to the device on the copy_in
    stream and keeps that copy's fence on the slot: the buffer goes back to the pool, or is staged again,
    only after the fence is waited for (see [Note: streams] in zinf/runtime/streams.py).
    """

    tier = "nvme"

    def __init__(self, groups: Sequence["FlatParamGroup"], swap: SwapSpace, room: PoolRoom, reserve_bytes: int,
                 in_place: Mapping[int, InPlaceRecord] | None = None, *, streams: Streams) -> None:
        self.swap, self.room, self.pool = swap, room, room.pool
        self._streams = streams  # the engine's: copies in on its copy_in stream
        # frozen groups that keep reading from the checkpoint's files (``in_place``, by group id: see [Note: frozen
        # shards in place] in in_place.py); every other group gets a swap record
        in_place = in_place or {}
        self.records: dict[int, Record | InPlaceRecord] = {
            id(g): in_place.get(id(g)) or swap.allocate(g.shard_nbytes) for g in groups}
        self._names = {id(g): g.name for g in groups}  # for the nvme_read / nvme_write regions
        self._slots: dict[int, Slot] = {}  # insertion order: the most recently filled last
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
            group.residence.take_in_place(group)  # it stays where it lies: nothing to read or write
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
        return sum(r.nbytes // r.ranks for r in self.records.values() if isinstance(r, InPlaceRecord))

    def _data(self, group: "FlatParamGroup", buf: torch.Tensor, own: bool = False) -> torch.Tensor:
        """The shard in ``buf`` (a frozen one where it landed); of a group read whole, every rank's, or with ``own``
        this rank's alone ([Note: frozen groups read whole] in zinf/offload/whole_reads.py)."""
        rec = self.records[id(group)]
        if isinstance(rec, InPlaceRecord) and rec.ranks > 1 and own:
            return rec.rank_of(buf, group.rank).view(group.storage_dtype)
        return buf[rec.start : rec.start + rec.nbytes].view(group.storage_dtype)

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
            if not demand and not self._room_to_read_ahead(rec.span):
                return False
            try:
                buf = self.pool.acquire(rec.span)
            except PoolExhaustedError:
                return False
            with region("nvme_read", group.name):
                handle = self.swap.submit_read(rec, buf)
            self._slots[key] = Slot.reading(buf, handle)
            return True

    def _room_to_read_ahead(self, span: int) -> bool:
        """Room for a read-ahead of ``span`` bytes beyond the reserve. Slots kept only for the backward give theirs,
        least recently gathered first (the forward's first modules, which the backward reaches last): kept slots
        otherwise fill the pool down to the reserve within a few modules, and every later read of the forward
        waited for the disk (measured on a 13B LoRA step: the reads' whole time, 15 s a rank, stalled compute)."""
        while self.pool.capacity_bytes - self.pool.bytes_in_use < self.reserve_bytes + 2 * span:
            kept = [(s.used, k) for k, s in self._slots.items() if s.state is SlotState.KEPT and s.write is None]
            if not kept:
                return False
            self._drop(min(kept)[1])
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

    def fetch(self, group: "FlatParamGroup", defer_check: bool = False) -> torch.Tensor:
        """The shard in its slot (read now if it was not read ahead). ``defer_check``: the caller's copy of it takes
        a frozen shard's checksum (``take_check``; [Note: one pass per byte] in zinf/offload/in_place.py)."""
        deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
        while True:
            # the read is started (or found) and its slot taken under one hold of the lock: in between, the
            # background optimizer step's room-maker could evict the idle slot (seen as a KeyError on one rank,
            # then a collective mismatch, with overlap_optimizer and a pool smaller than the shards)
            with self._lock:
                if self.prefetch(group, demand=True):
                    return self._hand_to_gather(group, defer_check)
            if self.room.make_room():
                continue
            if time.monotonic() > deadline:  # nothing came free: the optimizer step holds the rest
                raise MemoryError(f"zinf offload: the pinned pool cannot stage {group.name}; raise offload.pinned_pool_bytes")
            time.sleep(0.002)

    def take_check(self, group: "FlatParamGroup") -> ContentCheck | None:
        """After ``fetch(group, defer_check=True)``: the checksum the caller's copy must verify, or None (nothing
        left unchecked: a shard from the swap, already checked, or copied to a device apart). A slot is still
        unchecked after ``fetch`` only where the check was left to the caller."""
        key = id(group)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or not slot.unchecked:
                return None
            return ContentCheck(self.records[key].check_crc, slot.checked, lambda: self._refused(group))

    def _hand_to_gather(self, group: "FlatParamGroup", defer_check: bool = False) -> torch.Tensor:
        """The slot that ``prefetch`` has just made or found, handed to the gather (the caller holds the lock)."""
        key = id(group)
        slot = self._slots[key]
        assert not slot.staged, f"{group.name}: gathered while its update is being staged"
        rec = self.records[key]
        defer = defer_check and isinstance(rec, InPlaceRecord) and rec.crc is not None \
            and not device_is_apart(group.device)
        if slot.read is not None:
            self._finish_read(key, slot, defer)
        if slot.unchecked and not defer:  # left to a gather that did not take it: taken now
            self._check_content(key, slot)
        # the buffer goes back to the pool (or is staged again) only once this copy has read it
        source, copied = copy_in(self._streams, group, self._data(group, slot.buf))
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

    def release_kept(self, groups: Sequence["FlatParamGroup"]) -> None:
        """[Note: kept slots before an update]
        A backward starts that the step follows, and ``groups`` (trained ones) stay gathered from the forward: the
        backward does not gather them, and the step stages their new shards. Their kept slots would hold pool room
        through the backward for nothing, room the optimizer's read-ahead of the next step's states needs (measured
        on a 29.5M GPT with a 512 MiB pool: no sub-group read ahead with the slots kept, 20 of 53 without them,
        and the forward's waits for the update fell from 0.063 to 0.023 s a step). They go now, or once their
        write has finished; the step's ``writer`` takes new buffers."""
        with self._lock:
            for g in groups:
                slot = self._slots.get(id(g))
                if slot is None or slot.state is not SlotState.KEPT:
                    continue
                slot.let_go()
                if slot.write is None:
                    self._drop(id(g))
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
                if slot.unchecked:
                    self._check_content(key, slot)
                return self._data(group, slot.buf, own=True).clone()
        # no slot: the file holds the shard (a slot is dropped only once its write has finished)
        rec = self.records[key]
        buf = self.room.acquire_waiting(rec.span)
        try:
            with region("nvme_read", group.name):
                self.swap.wait(self.swap.submit_read(rec, buf), rec)
            self.swap.verify(rec, buf)
            return self._data(group, buf, own=True).clone()
        finally:
            self.pool.release(buf)

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        key = id(group)
        rec = self.records[key]
        if isinstance(rec, InPlaceRecord):  # new values (a load into the engine): a swap record of its own
            with self._lock:
                if key in self._slots:  # what was read from the files is stale
                    self._drop(key)
            self.records[key] = self.swap.allocate_late(rec.nbytes // rec.ranks)
            group.residence.gather_own()  # every rank loads alike: all-gathered again on every rank
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.staged:  # the next sub-group of the same update
                return self._data(group, slot.buf)
            if slot is not None:
                assert slot.idle, f"{group.name}: its shard is updated while a gather uses it"
                self._finish_io(key, slot)
                self._slots[key] = self._slots.pop(key)  # most recently filled: last
                slot.stage()  # waits for its last copy to the device
                return self._data(group, slot.buf)
        buf = self.room.acquire_waiting(self.records[key].span)  # not under the lock: done() frees room
        with self._lock:
            self._slots[key] = Slot.staging(buf)
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

    def _finish_read(self, key: int, slot: Slot, defer: bool = False, check: bool = True) -> None:
        """Wait for ``slot``'s read and check what it read (``defer``: a frozen shard's checksum left unchecked, for
        the gather's copy to take; without ``check``, a slot being dropped: nothing it read is used). What fails
        its check is thrown away, so it is never handed out, and a file put back is read again."""
        rec = self.records[key]
        assert slot.read is not None
        with region("nvme_read", self._names[key]):
            self.swap.wait(slot.read, rec)
        slot.read_done(unchecked=defer)
        if check:
            self._verified(key, slot, lambda: self.swap.verify(rec, slot.buf, content=not defer))

    def _verified(self, key: int, slot: Slot, verify: Callable[[], None]) -> None:
        """Run ``verify`` on ``slot``'s bytes; where it raises, the slot leaves the cache and its buffer the pool."""
        try:
            verify()
        except BaseException:
            if self._slots.get(key) is slot:
                del self._slots[key]
            self.pool.release(slot.release())
            raise

    def _refused(self, group: "FlatParamGroup") -> None:
        """A deferred check refused the bytes its gather was handed: the slot goes back and is dropped (the group
        stays SHARDED; a file put back is read again at its next gather)."""
        with self._lock:
            key = id(group)
            slot = self._slots[key]
            slot.give_back(self._clock, keep=False)
            if slot.write is None:
                self._drop(key)
        self.room.room_given_back()

    def _check_content(self, key: int, slot: Slot) -> None:
        """The checksum of a slot whose deferred check never ran (its gather failed before it) taken now."""
        rec = self.records[key]
        assert isinstance(rec, InPlaceRecord)
        with self.swap.timers.time("checksum"):
            self._verified(key, slot, lambda: rec.check(slot.buf))
        slot.checked()

    def _finish_io(self, key: int, slot: Slot, check: bool = True) -> None:
        """Finish the I/O in flight on ``slot`` (without ``check``: it is being dropped)."""
        if slot.read is not None:
            self._finish_read(key, slot, check=check)
        if slot.write is not None:
            with region("nvme_write", self._names[key]):
                self.swap.wait(slot.write, self.records[key])
            slot.write_done()

    def _drop(self, key: int) -> None:
        slot = self._slots.pop(key)
        assert slot.idle
        self._finish_io(key, slot, check=False)
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
