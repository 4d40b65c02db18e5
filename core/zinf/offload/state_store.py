"""Where an offloaded optimizer's fp32 master and moments live: host memory or NVMe records.

Both stores hand the optimizer one sub-group at a time (``sweep``) and keep what it wrote back; they
are also the groups' master home (``read_master`` / ``write_master``) and the checkpoint's source of
optimizer state (``read_states`` / ``write_states``). The host store is here; the NVMe store, which reads,
steps and writes its records as a pipeline, is zinf/offload/nvme_state_store.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from zinf.offload.state_layout import StateLayout
from zinf.offload.subgroups import STATES, SubGroup
from zinf.param.store import UpdateFence

if TYPE_CHECKING:
    from zinf.offload.record_check import RecordCheck
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["StateStore", "CpuStateStore", "in_group_order"]


def in_group_order(subgroups: Sequence[SubGroup], groups: Sequence["FlatParamGroup"]) -> list[SubGroup]:
    """The sub-groups by their group's place in ``groups`` (those of groups not in it last), each group's sub-groups
    and the unplaced ones in the order they had."""
    place = {id(g): i for i, g in enumerate(groups)}
    return sorted(subgroups, key=lambda sg: place.get(id(sg.group), len(place)))


class StateStore:
    """What both tiers share: the sub-group index and the master-home calls."""

    tier = "cpu"

    def __init__(self, subgroups: Sequence[SubGroup], fence: UpdateFence, layout: StateLayout | None = None) -> None:
        self.subgroups = list(subgroups)
        self.fence = fence
        self.layout = layout or StateLayout()  # the states as ``optimizer_storage`` keeps them
        self._of: dict[int, list[SubGroup]] = {}
        for sg in self.subgroups:
            self._of.setdefault(id(sg.group), []).append(sg)

    def reorder(self, groups: Sequence["FlatParamGroup"]) -> None:
        """Sweep the sub-groups of ``groups`` first, in that order, then the others as before (between steps)."""
        self.subgroups = in_group_order(self.subgroups, groups)

    def of(self, group: "FlatParamGroup") -> list[SubGroup]:
        return self._of.get(id(group), [])

    def take_initial(self, group: "FlatParamGroup") -> None:
        """Take the fp32 master ``group`` was built with (moments start at zero); the group no longer holds it."""
        master = group.master_shard.hand_over(group.trainable)
        zeros = torch.zeros_like(master, dtype=self.layout.checkpoint_dtype("exp_avg"))
        self.write_states(group, {"master": master, "exp_avg": zeros, "exp_avg_sq": zeros})

    def read_master(self, group: "FlatParamGroup") -> torch.Tensor:
        return self.read_states(group)["master"]

    def write_master(self, group: "FlatParamGroup", master: torch.Tensor) -> None:
        self.write_states(group, {"master": master})

    def state_bytes(self) -> int:
        return self.layout.state_bytes(self.subgroups)

    def read_states(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _outputs(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        """Tensors to read ``group``'s states into: empty for a group with no sub-group (a frozen group keeps no
        state; see [Note: frozen groups] in zinf/param/master.py)."""
        numel = group.shard_numel if self.of(group) else 0
        return {name: torch.empty(numel, dtype=self.layout.checkpoint_dtype(name)) for name in STATES}

    def write_states(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def finish_writes(self) -> None:
        """Wait for the last step's writes still on their way (NVMe); nothing in memory."""
        return None

    def read_ahead_states(self) -> None:
        """Start reading the next step's first states where they are on NVMe; nothing in memory."""
        return None


class CpuStateStore(StateStore):
    """[Note: one fp32 master on the host] Where a group's parameter shard is itself an fp32 tensor in host memory
    (parameters on the CPU, or on a CPU compute device), ``shards`` names it and its sub-groups' masters are views
    of it: the CPU-Adam steps the shard the forward reads, and the parameters cost 16 bytes each (shard and master 4,
    moments 8, gradient 4) instead of 20; 12 with bf16 moments, 10 with int8 ones (``optimizer_storage``). Not with
    ``step_during_backward``, whose early steps write the master before the step after the backward has checked
    them (zinf/optim/early_steps.py)."""

    tier = "cpu"

    def __init__(self, subgroups: Sequence[SubGroup], fence: UpdateFence,
                 shards: dict[int, torch.Tensor] | None = None, layout: StateLayout | None = None) -> None:
        super().__init__(subgroups, fence, layout)
        shards = shards or {}
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}
        self._shared = 0  # elements whose master is their parameter shard
        for sg in self.subgroups:
            shard = shards.get(id(sg.group))
            self._tensors[id(sg)] = self._empty(sg)
            if shard is not None:
                self._tensors[id(sg)]["master"] = shard[sg.lo : sg.hi]
                self._shared += sg.numel

    def _empty(self, sg: SubGroup) -> dict[str, torch.Tensor]:
        """``sg``'s arrays, zero (where the store keeps them)."""
        return self.layout.empty(sg)

    def state_bytes(self) -> int:
        return super().state_bytes() - self._shared * 4

    def begin_step(self) -> None:
        return None

    def cancel_step(self) -> None:
        return None

    def on_background_thread(self) -> None:
        return None

    def sweep(self) -> Iterator[tuple[SubGroup, dict[str, torch.Tensor], "RecordCheck | None"]]:
        """Every sub-group's states, in order, with the check of their content where it is left to the stepper
        (none here: they never left memory)."""
        for sg in self.subgroups:
            yield sg, self._tensors[id(sg)], None

    def states_of(self, sg: SubGroup) -> dict[str, torch.Tensor]:
        """``sg``'s master and moments, in place (a step taken during the backward: zinf/optim/early_steps.py)."""
        return self._tensors[id(sg)]

    def read_states(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        self.fence.wait_all()
        out = self._outputs(group)
        for sg in self.of(group):
            for name, value in self.layout.readable(sg, self._tensors[id(sg)]).items():
                out[name][sg.lo : sg.hi].copy_(value)
        return out

    def write_states(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        self.fence.wait_all()
        for sg in self.of(group):
            given = self.layout.storable(sg, {name: value[sg.lo : sg.hi] for name, value in states.items()})
            for name, value in given.items():
                mine = self._tensors[id(sg)][name]
                if mine.data_ptr() != value.data_ptr():  # a shared master handed over as itself
                    mine.copy_(value)

    def quiesce(self) -> None:
        return None
