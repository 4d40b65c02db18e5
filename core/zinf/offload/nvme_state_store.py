"""The offloaded optimizer's fp32 master and moments in NVMe records, read, stepped and written back one sub-group
at a time as a pipeline.

[Note: trailing writes]
With states on NVMe a stepped sub-group's writes are not waited for at once: they trail behind the
step while the pool has room, so the step (and the forward waiting on it) moves at the speed of the
reads and the Adam math, not of the writes. Before the next sub-group's reads are submitted, the
oldest trailing writes are finished until the pool keeps ``param_reserve_bytes`` free beyond those
reads, room the parameter store needs to stage shards for the forward and backward. Any thread that
needs a pool buffer may finish the oldest trailing write to get one (an evictor of the pool room).

[Note: the sweep's reads]
While a sub-group is stepped, the reads of the next one are in flight, and of the one after it where the pool has
room beside ``param_reserve_bytes`` (finishing trailing writes to make it); sub-groups whose reads add up to less
than ``READ_AHEAD_BYTES`` are read further ahead. So the disk reads while the CPU-Adam steps, whatever the size of a
sub-group, and a sub-group's records are verified before anything computed from them is used or written back
(by the stepper: [Note: checks in the Adam pass] in zinf/offload/record_check.py).

[Note: state read-ahead]
A step's master and moments do not depend on the gradient, so once a step's writes are done the
store starts reading the first sub-groups' states for the next step, into the pool room that the
backward leaves (``backward_reserve_bytes``: parameter shards to stage, gradient shards to write); the
pool room's listeners extend it as the backward releases shards. The next step starts from them, so the
forward that waits on it is not bound by the reads of its first groups. A thread short of pool room gives
them up (last first); new state from outside (``write_states``) drops them.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from zinf.native import PoolExhaustedError
from zinf.offload.grad_stash import NvmeGradStash
from zinf.offload.pool_room import OPTIMIZER, PoolRoom, block_bytes
from zinf.offload.record_check import RecordCheck
from zinf.offload.state_layout import StateLayout
from zinf.offload.state_store import StateStore, in_group_order
from zinf.offload.subgroups import SubGroup
from zinf.offload.swap import Record, SwapSpace
from zinf.param.store import UpdateFence
from zinf.param.grad_shard import GradState

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["NvmeStateStore", "READ_AHEAD_BYTES"]

READ_AHEAD_BYTES = 64 << 20  # small sub-groups: more are read ahead while their reads add up to less than this
READ_AHEAD_SUBGROUPS = 3  # the sub-group being stepped and the two after it, where the pool has room

_Reads = tuple[SubGroup, dict[str, torch.Tensor], dict[str, int]]  # a sub-group's buffers and their reads in flight


class NvmeStateStore(StateStore):
    tier = "nvme"

    def __init__(self, subgroups: Sequence[SubGroup], fence: UpdateFence, swap: SwapSpace, room: PoolRoom,
                 records: dict[int, dict[str, Record]], stash: NvmeGradStash | None, param_reserve_bytes: int,
                 backward_reserve_bytes: int, layout: StateLayout | None = None) -> None:
        super().__init__(subgroups, fence, layout)
        self.swap, self.room, self.stash = swap, room, stash
        self.records = {id(sg): {name: records[id(sg)][name] for name in self.layout.names} for sg in self.subgroups}
        self.param_reserve_bytes = param_reserve_bytes  # pool bytes trailing writes leave free for the parameter store
        self.backward_reserve_bytes = backward_reserve_bytes  # pool bytes the read-ahead leaves free for the backward
        # state writes trailing behind the step, oldest first; see [Note: trailing writes]
        self._trailing: collections.deque[tuple[SubGroup, dict[str, torch.Tensor], list[int]]] = collections.deque()
        self._lock = threading.Lock()
        # the first sub-groups' states read for the next step; see [Note: state read-ahead]
        self._preread: collections.deque[_Reads] = collections.deque()
        self._preread_lock = threading.Lock()  # one thread at a time extends the read-ahead
        self._writes_done = True  # the last step's state writes are finished: its records may be read ahead
        self._idle = threading.Event()  # no sweep is running (set), so records may be read and written from outside
        self._idle.set()
        room.add_evictor(OPTIMIZER, self.free_own)
        room.add_listener(self.read_ahead_states)

    # -- a record of one sub-group ------------------------------------------------------------
    def _rec(self, sg: SubGroup, name: str) -> Record:
        if name == "grad":
            assert self.stash is not None
            return self.stash.record(sg)
        return self.records[id(sg)][name]

    def _read_names(self, sg: SubGroup) -> tuple[str, ...]:
        """The records the step of ``sg`` reads: the states, and the gradient where it is in its record (not held in
        a pool buffer: [Note: gradients held for the step] in zinf/offload/grad_stash.py)."""
        stashed = self._stashed(sg) and not self.stash.holds(sg)  # type: ignore[union-attr]
        return self.layout.names + (("grad",) if stashed else ())

    def _stashed(self, sg: SubGroup) -> bool:
        return self.stash is not None and sg.group.grad.state is GradState.ON_NVME

    def _submit_reads(self, sg: SubGroup, names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Reads the step cannot go on without: wait for pool room if need be."""
        bufs = {name: self.room.acquire_waiting(self._rec(sg, name).span) for name in names}
        return bufs, {name: self.swap.submit_read(self._rec(sg, name), bufs[name]) for name in names}

    def _try_submit_reads(self, sg: SubGroup, names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, int]] | None:
        """Read-ahead: only into blocks the pool has now. Free bytes are not enough: the pool's buddy blocks can be
        too fragmented for a block of the size, and waiting for one while the sub-groups already read ahead hold
        the rest would wait for a buffer only this thread can give back."""
        bufs: dict[str, torch.Tensor] = {}
        try:
            for name in names:
                bufs[name] = self.room.pool.acquire(self._rec(sg, name).span)
        except PoolExhaustedError:
            for buf in bufs.values():
                self.room.pool.release(buf)
            return None
        return bufs, {name: self.swap.submit_read(self._rec(sg, name), bufs[name]) for name in names}

    # -- the step's pass over the sub-groups ---------------------------------------------------
    def begin_step(self) -> None:
        """A step is about to sweep (called before a background thread starts it): no read-ahead from now on."""
        self._writes_done = False
        self._idle.clear()

    def cancel_step(self) -> None:
        """The step that ``begin_step`` announced will not sweep (it failed before): records are free again."""
        self._idle.set()

    def on_background_thread(self) -> None:
        self.swap.mark_background_thread()

    def sweep(self) -> Iterator[tuple[SubGroup, dict[str, torch.Tensor], RecordCheck | None] | None]:
        """Every sub-group's states (and stashed gradient) in memory, in order, with the check of their content the
        caller takes before using them ([Note: checks in the Adam pass] in zinf/offload/record_check.py); what the
        caller wrote into the states is written back behind it (see [Note: trailing writes]). First a None, once the
        first reads are in flight."""
        self._idle.clear()
        try:
            yield from self._sweep()
        finally:
            self._idle.set()

    def _sweep(self) -> Iterator[tuple[SubGroup, dict[str, torch.Tensor], RecordCheck | None] | None]:
        self._retire_all()  # the last step's writes, where no read-ahead waited for them: these records are read now
        if self.stash is not None:
            self.stash.flush()
        with self._lock:
            reading, self._preread = self._preread, collections.deque()
        i = 0
        while i < len(reading):  # states read ahead: the gradient is read now
            sg, bufs, handles = reading[i]
            need = block_bytes(self._rec(sg, "grad").span) if "grad" in self._read_names(sg) else 0
            # the room the parameter store stages updated shards in stays free: those of the groups read ahead were
            # let go for this read-ahead ([Note: kept slots before an update] in nvme_param_store.py), and gradients
            # held for the step take room too ([Note: gradients held for the step] in grad_stash.py)
            fits = i == 0 or self.room.free_bytes - need >= self.param_reserve_bytes
            if not fits and not need:
                while len(reading) > i:
                    self._give_back(*reading.pop())
                break
            if need:
                more = self._try_submit_reads(sg, ("grad",)) if fits else None
                if more is None:  # no block for it now: the later read-ahead is given up (read again in turn)
                    while len(reading) > max(i, 1):
                        self._give_back(*reading.pop())
                    if i > 0:
                        break
                    more = self._submit_reads(sg, ("grad",))  # the first sub-group's: the step needs it now
                bufs.update(more[0])
                handles.update(more[1])
            i += 1
        upcoming = iter(self.subgroups[len(reading):])
        following = next(upcoming, None)
        primed = False
        for sg in self.subgroups:
            # see [Note: the sweep's reads]: the sub-group stepped now, the next one (two where the pool allows,
            # more while all of them read less than READ_AHEAD_BYTES), in room trailing writes and parameters leave
            while following is not None:
                if not reading:  # the sub-group stepped next: wait for room if need be
                    reading.append((following, *self._submit_reads(following, self._read_names(following))))
                elif (len(reading) < READ_AHEAD_SUBGROUPS or self._reading_bytes(reading) < READ_AHEAD_BYTES) \
                        and self._room_for(following):
                    reads = self._try_submit_reads(following, self._read_names(following))
                    if reads is None:
                        break
                    reading.append((following, *reads))
                else:
                    break
                following = next(upcoming, None)
            if not primed:  # the first reads are in flight: a driven sweep returns here at first, to wait for them
                primed = True  # only when a gather needs the update ([Note: a sweep the gathers drive])
                yield None
            read_sg, bufs, handles = reading.popleft()
            assert read_sg is sg
            for name in handles:
                self.swap.wait(handles[name], self._rec(sg, name))
            if "grad" not in bufs and self._stashed(sg):  # held in a pool buffer when its reads were submitted
                held = self.stash.take_held(sg)  # type: ignore[union-attr]
                if held is None:  # written since, to make room: read now
                    more, reads = self._submit_reads(sg, ("grad",))
                    self.swap.wait(reads["grad"], self._rec(sg, "grad"))
                    held = more["grad"]
                bufs["grad"] = held
            check = self._check(sg, bufs)
            views = {name: bufs[name][: self._rec(sg, name).nbytes].view(self.layout.dtype(name)) for name in bufs}
            grad_buf = bufs.pop("grad", None)
            try:
                yield sg, views, check
            finally:
                if grad_buf is not None:
                    self.room.pool.release(grad_buf)
            writes = [self.swap.submit_write(self.records[id(sg)][n], bufs[n], None if check is None else check.write_crc(n))
                      for n in self.layout.names]
            with self._lock:
                self._trailing.append((sg, bufs, writes))
        # the last writes trail into the backward (see [Note: trailing writes]); the thread that ran the sweep, which
        # may be the training thread, does not wait for them here
        self._settle_writes(wait=False)
        self.read_ahead_states()

    def _settle_writes(self, wait: bool) -> None:
        """Retire the trailing writes, oldest first: every one (``wait``), or those finished; the next step's records
        may be read ahead once none trails."""
        while True:
            with self._lock:
                if not self._trailing or not (wait or all(self.swap.aio.done(h) for h in self._trailing[0][2])):
                    break
            self._retire_oldest()
        with self._lock:
            self._writes_done = not self._trailing

    def finish_writes(self) -> None:
        """Wait for the last step's trailing writes and start the next step's read-ahead: the step is over on disk."""
        if not self._idle.is_set():
            return
        self._settle_writes(wait=True)
        self.read_ahead_states()

    def _retire_all(self) -> None:
        """Wait for every trailing write: the records are read next."""
        while self._retire_oldest():
            pass

    def _check(self, sg: SubGroup, bufs: dict[str, torch.Tensor]) -> RecordCheck | None:
        """The trailers of ``sg``'s records just read (``bufs``), checked; their content's check handed to the stepper
        with the states ([Note: checks in the Adam pass] in zinf/offload/record_check.py), or None without checksums."""
        if not self.swap.checksums:
            for name in bufs:
                self.swap.verify(self._rec(sg, name), bufs[name])
            return None
        records = {name: self._rec(sg, name) for name in bufs}
        return RecordCheck(self.swap, records, bufs, {n: self.swap.trailer_crc(r, bufs[n]) for n, r in records.items()})

    def _reading_bytes(self, reading: "collections.deque[_Reads]") -> int:
        return sum(self._rec(sg, name).span for sg, _, handles in reading for name in handles)

    def _room_for(self, sg: SubGroup) -> bool:
        """Whether ``sg``'s reads fit in the pool beside ``param_reserve_bytes``, after finishing trailing
        writes as far as needed (see [Note: trailing writes])."""
        need = sum(block_bytes(self._rec(sg, n).span) for n in self._read_names(sg)) + self.param_reserve_bytes
        while self.room.free_bytes < need:
            if not self._retire_oldest():
                return False
        return True

    def _retire_oldest(self) -> bool:
        """Finish the oldest trailing state writes and free their buffers; False if none trail."""
        with self._lock:
            if not self._trailing:
                return False
            sg, bufs, handles = self._trailing.popleft()
        for name, h in zip(self.layout.names, handles):
            self.swap.wait(h, self.records[id(sg)][name])
            self.room.pool.release(bufs[name])
        return True

    def reorder(self, groups: Sequence["FlatParamGroup"]) -> None:
        """As the host store's. The read-ahead is a prefix of the sweep's order: what was read ahead beyond the part
        the new order shares is given back (once per change of order) and read again in turn."""
        new = in_group_order(self.subgroups, groups)
        with self._preread_lock:
            while True:
                with self._lock:
                    ahead = [sg for sg, _, _ in self._preread]
                if all(a is b for a, b in zip(ahead, new)) or not self._drop_preread():
                    break
            with self._lock:
                self.subgroups = new

    # -- read-ahead of the next step's states --------------------------------------------------
    def read_ahead_states(self) -> None:
        """Extend the read-ahead of the next step's first sub-group states into the pool room there is
        now (see [Note: state read-ahead])."""
        if not self._writes_done and self._idle.is_set():  # the last sweep's writes may have finished since
            self._settle_writes(wait=False)
        if not self._writes_done or not self._preread_lock.acquire(blocking=False):
            return
        try:
            self._extend_read_ahead()
        finally:
            self._preread_lock.release()

    def _extend_read_ahead(self) -> None:
        room = self.room.free_bytes - self.backward_reserve_bytes
        while True:
            with self._lock:
                index = len(self._preread)
            if index == len(self.subgroups):
                return
            sg = self.subgroups[index]
            need = sum(block_bytes(self.records[id(sg)][n].span) for n in self.layout.names)
            if need > room:
                return
            bufs: dict[str, torch.Tensor] = {}
            try:
                for name in self.layout.names:
                    bufs[name] = self.room.pool.acquire(self.records[id(sg)][name].span)
            except PoolExhaustedError:
                for buf in bufs.values():
                    self.room.pool.release(buf)
                return
            handles = {name: self.swap.submit_read(self.records[id(sg)][name], bufs[name]) for name in self.layout.names}
            with self._lock:
                # the read-ahead is a prefix of the sub-groups: if another thread gave up some of it
                # meanwhile, this one no longer follows on
                follows = len(self._preread) == index
                if follows:
                    self._preread.append((sg, bufs, handles))
            if not follows:
                for name, handle in handles.items():
                    self.swap.wait(handle, self.records[id(sg)][name])
                    self.room.pool.release(bufs[name])
                return
            room -= need

    def _drop_preread(self) -> bool:
        """Give up the last sub-group read ahead for the next step; False if there is none."""
        with self._lock:
            if not self._preread:
                return False
            sg, bufs, handles = self._preread.pop()
        self._give_back(sg, bufs, handles)
        return True

    def _give_back(self, sg: SubGroup, bufs: dict[str, torch.Tensor], handles: dict[str, int]) -> None:
        """Finish the reads of a sub-group read ahead and release its buffers."""
        for name, handle in handles.items():
            self.swap.wait(handle, self._rec(sg, name))
            self.room.pool.release(bufs[name])

    def free_own(self) -> bool:
        """Free pool room this store holds without need: trailing writes first, then read-ahead."""
        return self._retire_oldest() or self._drop_preread()

    def quiesce(self) -> None:
        """Give back the states read ahead: afterwards the files alone hold the optimizer's state."""
        self._idle.wait()
        self._retire_all()
        while self._drop_preread():
            pass

    # -- whole groups, from outside the step (start-up, checkpoints, edits) ---------------------
    def read_states(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        """This rank's master and moments of ``group`` as host tensors of their stored dtypes (copies)."""
        self.fence.wait_all()
        self._idle.wait()
        self._retire_all()
        out = self._outputs(group)
        for sg in self.of(group):
            bufs: dict[str, torch.Tensor] = {}  # a sub-group's records at once, as the sweep holds them
            try:
                for name in self.layout.names:
                    rec = self.records[id(sg)][name]
                    bufs[name] = buf = self.room.acquire_waiting(rec.span)
                    self.swap.wait(self.swap.submit_read(rec, buf), rec)
                    self.swap.verify(rec, buf)
                stored = {n: b[: self.records[id(sg)][n].nbytes].view(self.layout.dtype(n)) for n, b in bufs.items()}
                for name, value in self.layout.readable(sg, stored).items():
                    out[name][sg.lo : sg.hi].copy_(value)
            finally:
                for buf in bufs.values():
                    self.room.pool.release(buf)
        return out

    def write_states(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        self.fence.wait_all()
        self._idle.wait()
        self._retire_all()
        while self._drop_preread():  # read before these states changed
            pass
        for sg in self.of(group):
            given = self.layout.storable(sg, {name: value[sg.lo : sg.hi] for name, value in states.items()})
            for name, value in given.items():
                rec = self.records[id(sg)][name]
                buf = self.room.acquire_waiting(rec.span)
                try:
                    buf[: rec.nbytes].view(self.layout.dtype(name)).copy_(value)
                    self.swap.wait(self.swap.submit_write(rec, buf), rec)
                finally:
                    self.room.pool.release(buf)
