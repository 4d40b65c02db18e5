"""What flat groups hold right now, per tier and kind, measured from the tensors themselves (the engine's
``resident_bytes`` adds what the placement, the optimizer and the same-host transport hold)."""

from __future__ import annotations

from typing import Sequence

import torch

from zinf.param.flat_group import FlatParamGroup
from zinf.report import tier_of

__all__ = ["group_bytes", "merge_bytes"]

Bytes = dict[str, dict[str, int]]  # tier -> kind -> bytes


def group_bytes(groups: Sequence[FlatParamGroup]) -> Bytes:
    """Parameter shards, fp32 masters (where they are not the shard), gradient shards, gathered buffers and flat
    gradients being assembled (which live where the group computes, as its full buffer)."""
    out: Bytes = {}

    def add(kind: str, t: torch.Tensor, nbytes: int | None = None) -> None:
        tier = out.setdefault(tier_of(t), {})
        tier[kind] = tier.get(kind, 0) + (t.untyped_storage().nbytes() if nbytes is None else nbytes)

    for g in groups:
        if g.shard is not None:
            add("param_shards", g.shard)
        if g.master is not None and (g.shard is None or g.master.data_ptr() != g.shard.data_ptr()):
            add("master", g.master)
        if g.grad.resident is not None:
            add("grad_shards", g.grad.resident)
        if g.owns_full:
            add("gathered", g.full)
        if g.grad_in.nbytes:
            add("grad_buffers", g.full, g.grad_in.nbytes)
    return out


def merge_bytes(parts: Sequence[Bytes]) -> Bytes:
    """The sum of several ``{tier: {kind: bytes}}``."""
    out: Bytes = {}
    for part in parts:
        for tier, kinds in part.items():
            merged = out.setdefault(tier, {})
            for kind, nbytes in kinds.items():
                merged[kind] = merged.get(kind, 0) + nbytes
    return out
