"""Module buffers (BatchNorm running statistics, counters) kept as DDP keeps them: rank 0's, sent to every rank.

[Note: buffers like DDP]
What ``torch.nn.parallel.DistributedDataParallel`` does with buffers (torch 2.13, distributed.py), with its
default ``broadcast_buffers=True``:

- *Which buffers*: all of ``module.named_buffers()``, persistent or not (``_assign_modules_buffers``; only
  names in ``_ddp_params_and_buffers_to_ignore`` are left out), collected again at every sync because a module
  may reassign a buffer. Rank 0 is the source (another rank only with the ``Join`` context for uneven inputs).
- *How*: ``_default_broadcast_coalesced`` -> ``dist._broadcast_coalesced``: flattened into buckets of one
  dtype and device each, under ``no_grad`` and ``_unsafe_preserve_version_counter`` (so a graph that saved a
  buffer, a previous forward not yet backpropagated, is not invalidated by the overwrite).
- *When*: at construction (``_sync_module_states`` with the parameters), and then at the *start* of
  ``DDP.forward`` (``_pre_forward`` -> ``_check_sync_bufs_pre_fwd`` -> ``_sync_buffers``) whenever
  ``will_sync_module_buffers()``: ``require_forward_param_sync and broadcast_buffers and`` the module had
  buffers when they were last collected. ``require_forward_param_sync`` starts True and is set at the end of
  every forward (``_post_forward``) to ``torch.is_grad_enabled() and require_backward_grad_sync``. Training
  or eval *mode* plays no part; grad mode does: a forward after a grad-enabled forward syncs, a forward after
  a ``no_grad`` (or ``inference_mode``) forward does not. So the first ``no_grad`` eval forward after training
  takes rank 0's statistics on every rank, later ``no_grad`` forwards keep them (an eval forward does not
  change them), and the last training forward's own update (made after the sync) stays per rank until the
  next forward: ``ddp.module.state_dict()`` on rank 1 is rank 1's then.

zinf does the same, from the root module's forward pre-hook (so every way of calling the model syncs: the
engine's forward, the Lightning and Fabric step root, Accelerate's wrapper, a direct ``engine.module(x)``)
and the root's forward hook (the grad mode at the end of the forward), before the pass's first gather: every
rank calls the root, so the broadcast pairs across ranks and never with a round (see [Note: rounds] in
zinf/schedule/rounds.py). One difference in the mechanics, none in the values: one broadcast of all buffers'
bytes (``Comm.broadcast_coalesced``) instead of one per dtype, as a broadcast copies bits. One difference in
when: zinf has no ``no_sync`` (every micro-batch's gradient is reduce-scattered; the front ends' ``no_sync`` is
a no-op), so every grad-enabled forward counts as DDP's synchronised one, where DDP skips the sync on the
forward after a ``no_sync`` micro-batch. That changes only the buffers of ranks other than 0 between
micro-batches, never rank 0's, and never what the first forward after an optimizer step sees.
``broadcast_buffers=False`` (DDP's old spelling: torch 2.13 deprecates it for ``forward_sync_buffers``,
which still syncs at construction) syncs neither at construction nor in forward: every rank keeps its own.
"""

from __future__ import annotations

import torch
from torch import nn

from zinf.runtime.context import RunContext
from zinf.runtime.logs import region

__all__ = ["BufferSync"]


class BufferSync:
    """Rank 0's buffers to every rank at construction and before a forward, as DDP; see [Note: buffers like DDP]."""

    def __init__(self, model: nn.Module, ctx: RunContext, enabled: bool) -> None:
        self.model = model
        self.comm = ctx.comm
        self.timers = ctx.timers
        self.enabled = enabled and ctx.comm.world > 1 and next(model.buffers(), None) is not None
        self.due = True  # DDP's require_forward_param_sync: the first forward syncs

    def broadcast(self) -> None:
        """Every rank's buffers take rank 0's values (collective; nothing when disabled)."""
        if not self.enabled:
            return
        buffers = tuple(self.model.buffers())  # collected again: a module may have reassigned one
        with region("broadcast_buffers", f"{len(buffers)} buffers"), torch.no_grad(), \
                torch.autograd._unsafe_preserve_version_counter(buffers):
            self.comm.broadcast_coalesced(buffers, src=0)

    def before_forward(self) -> None:
        if self.enabled and self.due:
            with self.timers.time("broadcast_buffers"):
                self.broadcast()

    def after_forward(self) -> None:
        self.due = torch.is_grad_enabled()
