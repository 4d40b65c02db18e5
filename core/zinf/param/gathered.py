"""Full parameters outside training: read them, or edit them and write the edit back to the shards."""

from __future__ import annotations

from typing import Iterable

from torch import nn

import torch

from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.registry import groups_of
from zinf.runtime.collectives import all_gather_now
from zinf.runtime.comm import Comm
from zinf.runtime.context import RunContext

__all__ = ["GatheredParameters", "gather_full_master"]


def gather_full_master(comm: Comm, group: FlatParamGroup, master: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's fp32 master of ``group`` (``master``: this rank's, read by the caller; else the group's),
    all-gathered through ``comm`` into one flat vector (checkpoints, exports, regrouping)."""
    local = master if master is not None else group.master_shard.read()
    full = torch.empty(group.padded_numel, dtype=torch.float32, device=group.device)
    return all_gather_now(comm, full, local)


class GatheredParameters:
    """Gather ``params`` (a module, one parameter, or an iterable of them) for the ``with`` block.

    With ``modifier_rank=None`` the block only reads. With ``modifier_rank=r`` the values rank ``r``
    holds at the end of the block are broadcast and written back into every rank's shard and fp32
    master, so an edit made on one rank (or identically on all) survives the release.

    The gathers run through ``ctx`` (an engine's ``engine.ctx``, which ``engine.gathered_parameters`` passes), else
    through a context of the default process group made for the block.
    """

    def __init__(self, params: nn.Module | nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 enabled: bool = True, ctx: RunContext | None = None) -> None:
        if isinstance(params, nn.Module):
            params = list(params.parameters())
        elif isinstance(params, nn.Parameter):
            params = [params]
        self.groups = groups_of(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.ctx = ctx

    def __enter__(self) -> "GatheredParameters":
        if self.groups and self.ctx is None:
            device = self.groups[0].device
            self.ctx = RunContext.build(Comm.current(device=device), device)
        for g in self.groups:
            assert self.ctx is not None
            g.layout.check_ranks(self.ctx.comm.rank, self.ctx.comm.world, g.name)
            g.acquire(self.ctx)
            if g.packed:
                _point_at_decoded(g)
        return self

    def __exit__(self, *exc: object) -> None:
        for g in self.groups:
            if self.modifier_rank is not None and exc[0] is None:
                assert self.ctx is not None
                self.ctx.comm.broadcast(g.full, src=self.modifier_rank)
                g.write_back()
            g.release()
        assert all(g.state is not GroupState.GATHERING for g in self.groups)


def _point_at_decoded(group: FlatParamGroup) -> None:
    """A packed group (its codes gathered for a layer that decodes them tile by tile: zinf/frozen_linear.py) read
    outside that layer: its parameters point at its values decoded into a buffer of their own, until its release."""
    values = torch.empty(group.padded_numel, dtype=group.compute_dtype, device=group.device)
    group.format.widen(group.full, group.world, group.shard_numel, values)
    for p, slot in zip(group.params, group.slots):
        if p is not None:
            p.data = values[slot.offset : slot.offset + slot.numel].view(slot.shape)
