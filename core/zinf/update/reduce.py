"""Gradients: full gradient of a group -> reduce-scatter -> this rank's fp32 gradient shard.

A group's reduce-scatter is issued (asynchronously) as soon as the last of its parameters has its
gradient, so communication runs behind the rest of backward; at most ``bucket_bytes`` of gradients
wait in flight before the oldest are drained into their shards. The shard holds the average over
ranks, accumulated across micro-batches until the optimizer step clears it.
"""

from __future__ import annotations

from typing import Any

import torch

from zinf.fetch.comm import Comm
from zinf.param.flat_group import FlatParamGroup
from zinf.report import StepTimers

__all__ = ["GradReducer"]


class GradReducer:
    def __init__(self, comm: Comm, bucket_bytes: int, timers: StepTimers) -> None:
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.timers = timers
        self._pending: list[tuple[FlatParamGroup, Any, torch.Tensor, torch.Tensor]] = []
        self._pending_bytes = 0

    def reduce(self, group: FlatParamGroup) -> None:
        full = group.take_grad_full()
        if self.comm.world == 1:
            group.grad_shard.add_(full)
            return
        out = torch.empty(group.shard_numel, dtype=full.dtype, device=full.device)
        with self.timers.time("reduce_scatter"), torch.profiler.record_function(f"zinf::reduce_scatter({group.name})"):
            work = self.comm.reduce_scatter_sum(out, full, async_op=True)
        self._pending.append((group, work, out, full))
        self._pending_bytes += full.numel() * full.element_size()
        while self._pending_bytes > self.bucket_bytes and len(self._pending) > 1:
            self._drain_one()

    def _drain_one(self) -> None:
        group, work, out, full = self._pending.pop(0)
        with self.timers.time("reduce_scatter"):
            work.wait()
        self._pending_bytes -= full.numel() * full.element_size()
        group.grad_shard.add_(out.to(torch.float32).div_(self.comm.world))

    def drain(self) -> None:
        while self._pending:
            self._drain_one()
