"""Gradient shards on NVMe (``offload.grads: nvme``, the default when the optimizer is there).

[Note: gradients on NVMe]
Each optimizer sub-group has a "grad" record. When a group's gradient is complete during backward (its
``GradShard.complete``: after its reduce-scatter, or its last gradient with one rank) the shard's statistics
are taken (zinf/param/grad_shard.py), it is copied into pool buffers, written, and freed, so gradient
memory is bounded by the writes in flight rather than the model. Clipping and fp16 unscaling stay pending
factors that the optimizer step applies inside its Adam pass when it reads the gradient back with the
states. A later micro-batch reads a stashed shard back before accumulating into it. The writes are
finished when backward ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from zinf.native.widen import copy_checked
from zinf.offload.pool_room import PoolRoom
from zinf.offload.subgroups import SubGroup
from zinf.offload.swap import Record, SwapSpace

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["NvmeGradStash", "GRAD_WRITES_IN_FLIGHT"]

GRAD_WRITES_IN_FLIGHT = 4  # gradient sub-group writes in flight during backward (each holds a pool buffer)


class NvmeGradStash:
    def __init__(self, swap: SwapSpace, room: PoolRoom, subgroups: Sequence[SubGroup],
                 records: dict[int, dict[str, Record]]) -> None:
        self.swap, self.room = swap, room
        self.records: dict[int, Record] = {id(sg): records[id(sg)]["grad"] for sg in subgroups}
        self._of: dict[int, list[SubGroup]] = {}
        for sg in subgroups:
            self._of.setdefault(id(sg.group), []).append(sg)
        self._writes: list[tuple[torch.Tensor, int, Record]] = []

    def record(self, sg: SubGroup) -> Record:
        return self.records[id(sg)]

    def write(self, group: "FlatParamGroup", shard: torch.Tensor) -> None:
        for sg in self._of.get(id(group), []):
            rec = self.records[id(sg)]
            buf = self.room.acquire_waiting(rec.span)
            try:
                out, src = buf[: rec.nbytes].view(torch.float32), shard[sg.lo : sg.hi]
                if self.swap.checksums:  # the CRC32C taken by the copy's pass: [Note: one pass per byte] in in_place.py
                    handle = self.swap.submit_write(rec, buf, copy_checked(out, src))
                else:
                    out.copy_(src)
                    handle = self.swap.submit_write(rec, buf)
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
            buf = self.room.acquire_waiting(rec.span)
            try:
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
