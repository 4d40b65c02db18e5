"""Gradients: full gradient of a group -> reduce-scatter -> this rank's fp32 gradient shard.

A group whose gradients are complete joins the current bucket; once the bucket holds
``bucket_bytes`` it is reduce-scattered (asynchronously, so communication runs behind the rest of
backward) and at most two buckets are in flight before the oldest is drained into its shards.
Several groups in one bucket are laid out rank-major (rank r's slices of every group, then rank
r+1's), so one collective lands each group's slice in its place; a bucket of one group is reduced
in place with no copy. The shard holds the average over ranks, accumulated across micro-batches
until the optimizer step clears it.

With CUDA the reduce-scatter runs on the reduce_scatter stream once it has waited for compute, and a
shard that lives in host memory leaves the device on the copy_out stream without the host waiting (see
[Note: streams] in zinf/runtime/streams.py and [Note: gradient landing] in zinf/param/grad_shard.py); the
compute stream waits for each such copy one drain later (at the end of the backward for the last ones), and
only then are the device tensors it read let go. On CPU these are the plain calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from zinf.device_memory import mark_device
from zinf.runtime import collectives
from zinf.runtime.context import RunContext
from zinf.runtime.streams import BufferFence, InFlight

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["GradReducer"]

_MAX_IN_FLIGHT = 2


class GradReducer:
    def __init__(self, ctx: RunContext, bucket_bytes: int,
                 on_complete: Callable[["FlatParamGroup"], None] | None = None) -> None:
        self.ctx = ctx
        self.comm = ctx.comm
        self.host = ctx.host  # told of every flat gradient allocated and freed
        self._counted: dict[FlatParamGroup, int] = {}  # groups whose flat gradient ``host`` counts, its bytes
        self.on_complete = on_complete  # told when a group's gradient shard is complete (an early optimizer step)
        self.bucket_bytes = bucket_bytes
        self.timers = ctx.timers
        self._bucket: list[tuple[FlatParamGroup, torch.Tensor]] = []
        self._bucket_bytes = 0
        # (the reduce-scatter, holding its input and output until compute waited for it,
        #  [(group, its slice of the output)])
        self._in_flight: list[tuple[InFlight, list[tuple[FlatParamGroup, torch.Tensor]]]] = []
        self._copies_out: list[BufferFence] = []  # gradient slices on their way to host memory

    def accumulate(self, group: FlatParamGroup, param: torch.nn.Parameter, grad: torch.Tensor,
                   reduce_dtype: torch.dtype) -> bool:
        """Add one parameter's gradient into ``group``'s flat gradient (``FlatGrad.add``); True once
        every one has arrived. The flat gradient's bytes count as the engine's from its first gradient on."""
        complete = group.grad_in.add(group.index_of(param), grad, reduce_dtype, group.grad)
        self._count(group, group.grad_in.nbytes)
        return complete

    def abandon(self, groups: Sequence[FlatParamGroup]) -> None:
        """A backward raised: its partial flat gradients, bucketed gradients and the results of its reduce-scatters in
        flight (waited for: every rank issued them) are dropped, so that none of it reaches a gradient shard ([Note: a
        backward that raised] in zinf/update/accumulation.py)."""
        for group, _ in self._bucket:
            self._uncount(group)
        self._bucket, self._bucket_bytes = [], 0
        while self._in_flight:
            self._drain_one(land=False)
        self._let_go()
        for g in groups:
            if g.grad_in.pending:
                self.forget(g)

    def forget(self, group: FlatParamGroup) -> None:
        """``group``'s partial gradients are dropped (a backward that raised)."""
        group.grad_in.take(torch.float32, group.grad.off_device)
        self._uncount(group)

    def _count(self, group: FlatParamGroup, nbytes: int) -> None:
        if nbytes and group not in self._counted:
            self._counted[group] = nbytes
            self.host.allocated("grad_buffers", nbytes, group.device)

    def _uncount(self, group: FlatParamGroup) -> None:
        nbytes = self._counted.pop(group, 0)
        self.host.freed("grad_buffers", nbytes, group.device)

    def reduce(self, group: FlatParamGroup, reduce_dtype: torch.dtype = torch.float32) -> None:
        """Reduce-scatter ``group``'s flat gradient. With several ranks, only in the order every rank agreed
        on (see [Note: rounds] in zinf/schedule/rounds.py)."""
        full = group.grad_in.take(reduce_dtype, group.grad.off_device)
        if full is None:  # one rank: accumulated in place (FlatGrad.add)
            self._complete(group)
            return
        nbytes = full.numel() * full.element_size()
        self._count(group, nbytes)  # counted already unless zeros were made: this rank had none of its gradients
        self._bucket.append((group, full))
        self._bucket_bytes += nbytes
        if self._bucket_bytes >= self.bucket_bytes:
            self._issue()

    def drain(self) -> None:
        """Reduce what is still bucketed and wait for every reduce-scatter."""
        if self._bucket:
            self._issue()
        while self._in_flight:
            self._drain_one()
        self._let_go()

    def _issue(self) -> None:
        items, self._bucket, self._bucket_bytes = self._bucket, [], 0
        world = self.comm.world
        if len(items) == 1:
            group, full = items[0]
            out = torch.empty(group.shard_numel, dtype=full.dtype, device=full.device)
            slices, source = [(group, out)], full
        else:
            total = sum(g.shard_numel for g, _ in items)
            full = torch.empty(world, total, dtype=items[0][1].dtype, device=items[0][1].device)
            out = torch.empty(total, dtype=full.dtype, device=full.device)
            slices, offset = [], 0
            for group, gfull in items:
                full[:, offset : offset + group.shard_numel].copy_(gfull.view(world, group.shard_numel))
                slices.append((group, out[offset : offset + group.shard_numel]))
                offset += group.shard_numel
            source = full
        mark_device(out, source)
        label = items[0][0].name if len(items) == 1 else f"{len(items)} groups"
        with self.timers.time("reduce_scatter"):
            work = collectives.reduce_scatter(self.ctx, out, source, label)
        self._in_flight.append((work, slices))
        while len(self._in_flight) > _MAX_IN_FLIGHT:
            self._drain_one()

    def _drain_one(self, land: bool = True) -> None:
        """Wait for the oldest reduce-scatter in flight and land its slices in the gradient shards (``land`` False:
        dropped, for a backward that raised)."""
        work, slices = self._in_flight.pop(0)
        with self.timers.time("reduce_scatter"):
            done = work.join()  # compute waits for the reduce-scatter; its input gradient may then be freed
        self._let_go()
        for group, part in slices if land else ():
            copy = group.grad.add_reduced(part, self.comm.world, done, self.ctx.streams)
            if copy is not None:
                self._copies_out.append(copy)
            self._complete(group)
        del work, done  # the full gradients it held are freed now
        for group, _ in slices:
            self._uncount(group)

    def _complete(self, group: FlatParamGroup) -> None:
        group.grad.complete()
        if self.on_complete is not None:
            self.on_complete(group)

    def _let_go(self) -> None:
        """The compute stream waits for the copies off the device issued so far, then the device tensors they read
        are let go (rule 2 of [Note: streams])."""
        while self._copies_out:
            copy = self._copies_out.pop(0)
            copy.make_wait(self.ctx.streams.current())
            copy.release()
