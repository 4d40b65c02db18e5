"""Gradient shards on NVMe (``offload.grads: nvme``, the default when the optimizer is there).

[Note: gradients on NVMe]
Each optimizer sub-group has a "grad" record. When a group's gradient is complete during backward (its
``GradShard.complete``: after its reduce-scatter, or its last gradient with one rank) the shard's statistics
are taken (zinf/param/grad_shard.py), it is copied into pool buffers, written, and freed, so gradient
memory is bounded by the writes in flight rather than the model. Clipping and fp16 unscaling stay pending
factors that the optimizer step applies inside its Adam pass when it reads the gradient back with the
states. A later micro-batch reads a stashed shard back before accumulating into it. The writes are
finished when backward ends.

[Note: gradients held for the step]
The step that follows a backward sweeps the sub-groups in the next forward's order, the reverse of the order the
backward completes them: the gradients completed last are read back first, moments after they were written. So a
backward that the step follows (``hold_for_step``) keeps the gradients of the sweep's first sub-groups in their pool
buffers, up to a quarter of the pool: stamped with their record's trailer as a write would, never written, and
handed to the sweep as if read back (its Adam pass checks them as it checks what it reads). Each is a write and a
read the disk does not do. A thread short of pool room has them written after all, the one needed last first (the
pool room's last evictor), and the step reads those back. A later micro-batch reads a held gradient from its buffer;
a step that does not come (``forget``) gives the buffers back.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import torch

from zinf.native.widen import copy_checked
from zinf.offload.pool_room import HELD_GRADS, PoolRoom, block_bytes
from zinf.offload.subgroups import SubGroup
from zinf.offload.swap import Record, SwapSpace

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["NvmeGradStash", "GRAD_WRITES_IN_FLIGHT", "held_count"]

GRAD_WRITES_IN_FLIGHT = 4  # gradient sub-group writes in flight during backward (each holds a pool buffer)


def held_count(spans: Sequence[int], pool_bytes: int) -> int:
    """How many of the sweep's first gradient records (``spans``, in its order) a step holds: while their pool blocks
    fit a quarter of the pool ([Note: gradients held for the step])."""
    room = pool_bytes // 4
    for count, span in enumerate(spans):
        room -= block_bytes(span)
        if room < 0:
            return count
    return len(spans)


class NvmeGradStash:
    def __init__(self, swap: SwapSpace, room: PoolRoom, subgroups: Sequence[SubGroup],
                 records: dict[int, dict[str, Record]]) -> None:
        self.swap, self.room = swap, room
        self.records: dict[int, Record] = {id(sg): records[id(sg)]["grad"] for sg in subgroups}
        self._of: dict[int, list[SubGroup]] = {}
        for sg in subgroups:
            self._of.setdefault(id(sg.group), []).append(sg)
        self._writes: list[tuple[torch.Tensor, int, Record]] = []
        self._to_hold: set[int] = set()  # sub-groups whose gradients this backward holds (by id)
        self._held: dict[int, torch.Tensor] = {}  # by sub-group id: a stamped buffer, the record not written
        self._held_lock = threading.Lock()  # the step's thread takes them, a thread short of room writes them
        room.add_evictor(HELD_GRADS, self._write_one_held)

    def record(self, sg: SubGroup) -> Record:
        return self.records[id(sg)]

    def hold_for_step(self, subgroups: Sequence[SubGroup]) -> None:
        """The gradients of ``subgroups`` completed from now on stay in pool buffers for the step ([Note: gradients
        held for the step]); none with an empty list."""
        self._to_hold = {id(sg) for sg in subgroups}

    def holds(self, sg: SubGroup) -> bool:
        """Whether ``sg``'s gradient waits in a pool buffer rather than in its record (now: see ``take_held``)."""
        return id(sg) in self._held

    def take_held(self, sg: SubGroup) -> torch.Tensor | None:
        """The buffer holding ``sg``'s gradient, for the step to use and give back to the pool; None where it is in
        its record (never held, or written since to make room)."""
        with self._held_lock:
            return self._held.pop(id(sg), None)

    def forget(self, group: "FlatParamGroup") -> None:
        """``group``'s gradient is dropped without a step: the buffers holding it go back to the pool."""
        for sg in self._of.get(id(group), []):
            buf = self.take_held(sg)
            if buf is not None:
                self.room.pool.release(buf)

    def _write_one_held(self) -> bool:
        """Write the held gradient the step needs last to its record and give its buffer back (a pool room evictor);
        False if none is held."""
        with self._held_lock:
            if not self._held:
                return False
            key = next(iter(self._held))  # held first: completed first by the backward, stepped last
            buf, rec = self._held.pop(key), self.records[key]
            try:
                self.swap.wait(self.swap.submit_stamped(rec, buf), rec)
            finally:
                self.room.pool.release(buf)
        return True

    def write(self, group: "FlatParamGroup", shard: torch.Tensor) -> None:
        for sg in self._of.get(id(group), []):
            rec = self.records[id(sg)]
            buf = self.room.acquire_waiting(rec.span)
            try:
                out, src = buf[: rec.nbytes].view(torch.float32), shard[sg.lo : sg.hi]
                crc = None
                if self.swap.checksums:  # the CRC32C taken by the copy's pass: [Note: one pass per byte] in in_place.py
                    crc = copy_checked(out, src)
                else:
                    out.copy_(src)
                if id(sg) in self._to_hold:  # as if written and read back ([Note: gradients held for the step])
                    self.swap.stamp(rec, buf, crc)
                    with self._held_lock:
                        self._held[id(sg)] = buf
                    continue
                handle = self.swap.submit_write(rec, buf, crc)
            except BaseException:
                self.room.pool.release(buf)
                raise
            self._writes.append((buf, handle, rec))
            while len(self._writes) > GRAD_WRITES_IN_FLIGHT:
                self._finish_one()

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        """A stashed shard read back into host memory (its pending factors are the shard's to apply)."""
        self.flush()
        out = torch.zeros(group.shard_numel, dtype=torch.float32)
        for sg in self._of.get(id(group), []):
            rec = self.records[id(sg)]
            held = self.take_held(sg)
            buf = held if held is not None else self.room.acquire_waiting(rec.span)
            try:
                if held is None:
                    self.swap.wait(self.swap.submit_read(rec, buf), rec)
                self.swap.verify(rec, buf)
                out[sg.lo : sg.hi].copy_(buf[: rec.nbytes].view(torch.float32))
            finally:
                self.room.pool.release(buf)
        return out

    def flush(self) -> None:
        """Finish the gradient writes still in flight (at the end of backward): every one, even after one failed (its
        buffer goes back to the pool), then raise the first failure."""
        failed: BaseException | None = None
        while self._writes:
            try:
                self._finish_one()
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _finish_one(self) -> None:
        """Wait for the oldest write; its buffer goes back to the pool whatever the wait raises (the request is over
        once ``wait`` returns or raises)."""
        buf, handle, rec = self._writes.pop(0)
        try:
            self.swap.wait(handle, rec)
        finally:
            self.room.pool.release(buf)
