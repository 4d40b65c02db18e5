"""How an offloaded optimizer cuts this rank's shards: sub-groups of at most ``offload.sub_group_numel``.

A sub-group is the unit of the offloaded step: its master, moments and (on NVMe) gradient are one record
each, read, stepped and written together. Its ``segments`` are the ranges some optimizer param group steps
(one per parameter, with the param group's index), its ``gaps`` the ranges nothing steps (padding, frozen
parameters, parameters the optimizer does not hold), which keep their values. A frozen group (every parameter
frozen when the engine was built) has no sub-group at all: no state, no records, no step (see [Note: frozen
groups] in zinf/param/flat_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from zinf.offload.pool_room import block_bytes
from zinf.offload.swap import record_span

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["SubGroup", "plan_subgroups", "subgroup_numels", "hyper_index", "STATES", "ALIGN_NUMEL"]

STATES = ("master", "exp_avg", "exp_avg_sq")
ALIGN_NUMEL = 1024  # sub-group boundaries stay 4096-byte aligned in fp32


@dataclass(eq=False)
class SubGroup:
    group: "FlatParamGroup"
    lo: int
    hi: int
    segments: list[tuple[int, int, int, int]]  # (lo, hi, optimizer param group index, slot), group-shard coordinates
    gaps: list[tuple[int, int]]
    last_of_group: bool

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def hyper_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Parameter id -> index of the optimizer param group holding it."""
    index: dict[int, int] = {}
    for i, pg in enumerate(optimizer.param_groups):
        for p in pg["params"]:
            index[id(p)] = i
    return index


def plan_subgroups(groups: Sequence["FlatParamGroup"], optimizer: torch.optim.Optimizer,
                   sub_group_numel: int) -> list[SubGroup]:
    hyper = hyper_index(optimizer)
    out: list[SubGroup] = []
    for g in groups:
        if not g.trainable:
            continue
        runs = []
        for i, p in enumerate(g.params):
            a, b = g.layout.local_range(i)
            if b > a and p is not None and p.requires_grad and id(p) in hyper:
                runs.append((a, b, hyper[id(p)], i))
        lo = 0
        for numel in subgroup_numels(g.shard_numel, sub_group_numel):
            hi = lo + numel
            segs = [(max(a, lo), min(b, hi), k, i) for a, b, k, i in runs if a < hi and b > lo]
            gaps, cursor = [], lo
            for a, b, _, _ in segs:
                if a > cursor:
                    gaps.append((cursor, a))
                cursor = b
            if cursor < hi:
                gaps.append((cursor, hi))
            out.append(SubGroup(g, lo, hi, segs, gaps, last_of_group=hi == g.shard_numel))
            lo = hi
    return out


def subgroup_numels(shard_numel: int, sub_group_numel: int) -> list[int]:
    """The sizes a trained group's shard of ``shard_numel`` is cut into, in order (the planner counts the same)."""
    # a record's trailer lives inside its span: one block less keeps a power-of-two sub-group's states
    # (and the pool's buddy blocks that stage them) at the power of two instead of rounding up to twice it
    size = max(ALIGN_NUMEL, (sub_group_numel - 1) // ALIGN_NUMEL * ALIGN_NUMEL)
    out, lo = [], 0
    while lo < shard_numel:
        out.append(_without_doubling(min(size, shard_numel - lo)))
        lo += out[-1]
    return out


def _without_doubling(numel: int) -> int:
    """The first ``numel`` elements of a sub-group, or fewer where its fp32 record's trailer would take it past a power
    of two: a group of 2**k elements (an embedding, an output projection) would otherwise stage each state in a
    pool block of twice its size. The elements left over make a small sub-group of their own, where the two blocks
    take less than the one."""
    cut = (numel - 1) // ALIGN_NUMEL * ALIGN_NUMEL
    if cut > 0 and _block(cut) + _block(numel - cut) < _block(numel):
        return cut
    return numel


def _block(numel: int) -> int:
    return block_bytes(record_span(numel * 4))
