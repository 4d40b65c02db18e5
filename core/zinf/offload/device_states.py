"""The device share of an offloaded optimizer: the masters and moments of the groups the next forward needs first,
kept on the compute device and stepped there (``offload.optimizer_device_fraction``).

[Note: the device share]
With the optimizer on the CPU, the step is bound by the CPU-Adam's pass over host memory, while the device, which
has just finished the backward, sits idle; the next forward's first groups wait for their update. A share of the
trained groups, the first ones built (for a model built in order, the first the forward needs), keeps its fp32
master and moments on the compute device, its gradient shard where the reduce-scatter left it, and its parameter
shard on the device tier: the training thread steps them there (``adam_step_torch``: the CPU-Adam's math in torch
operations, per parameter with its own step count, gradient factor and hyper-parameters) before the CPU sweeps the
rest in the background, so the forward starts on groups already updated and the CPU sweeps ``1 - fraction`` of the
parameters. The share is decided from the groups' shard sizes alone, identical on every rank. Its moments are kept in
fp32 whatever ``optimizer_storage`` says (that setting is the host's bytes); checkpoints hold them like any other
optimizer state, so a run resumes with another share or none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from zinf.device_memory import mark_device
from zinf.offload.state_store import CpuStateStore
from zinf.offload.subgroups import SubGroup
from zinf.param.store import UpdateFence

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["DeviceStateStore", "device_share", "groups_in_share"]


def groups_in_share(sizes: Sequence[int], fraction: float) -> int:
    """How many of the trained groups (``sizes``: their shards' elements, in build order) a share of ``fraction``
    takes: the first, while the elements taken so far are under ``fraction`` of all (whole groups; the planner
    counts a share the same way)."""
    target, taken = fraction * sum(sizes), 0
    for count, n in enumerate(sizes):
        if taken >= target:
            return count
        taken += n
    return len(sizes)


def device_share(groups: Sequence["FlatParamGroup"], fraction: float) -> set[int]:
    """The ids of the trained groups whose optimizer state stays on the device (see [Note: the device share])."""
    trained = [g for g in groups if g.trainable]
    return {id(g) for g in trained[: groups_in_share([g.shard_numel for g in trained], fraction)]}


class DeviceStateStore(CpuStateStore):
    """fp32 master and moments of the device share's sub-groups, in arrays on ``device`` (see [Note: the device
    share]); read, written and swept as the host's store does."""

    tier = "device"

    def __init__(self, subgroups: Sequence[SubGroup], fence: UpdateFence, device: torch.device) -> None:
        self.device = device
        super().__init__(subgroups, fence)

    def _empty(self, sg: SubGroup) -> dict[str, torch.Tensor]:
        out = self.layout.empty(sg, self.device)
        mark_device(*out.values())  # [Note: staged device] in zinf/device_memory.py
        return out
