"""Full parameters outside training: read them, or edit them and write the edit back to the shards."""

from __future__ import annotations

from typing import Iterable

from torch import nn

from zinf.param.flat_group import GroupState
from zinf.param.registry import groups_of

__all__ = ["GatheredParameters"]


class GatheredParameters:
    """Gather ``params`` (a module, one parameter, or an iterable of them) for the ``with`` block.

    With ``modifier_rank=None`` the block only reads. With ``modifier_rank=r`` the values rank ``r``
    holds at the end of the block are broadcast and written back into every rank's shard and fp32
    master, so an edit made on one rank (or identically on all) survives the release.
    """

    def __init__(self, params: nn.Module | nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 enabled: bool = True) -> None:
        if isinstance(params, nn.Module):
            params = list(params.parameters())
        elif isinstance(params, nn.Parameter):
            params = [params]
        self.groups = groups_of(params) if enabled else []
        self.modifier_rank = modifier_rank

    def __enter__(self) -> "GatheredParameters":
        for g in self.groups:
            g.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        for g in self.groups:
            if self.modifier_rank is not None and exc[0] is None:
                g.comm.broadcast(g.full, src=self.modifier_rank)
                g.write_back()
            g.release()
        assert all(g.state is not GroupState.GATHERING for g in self.groups)
