"""What the planner counts as gathered: the most full parameters gathered at once, the host's room for groups kept
from the forward to the backward, and which groups are kept, as the engine chooses them (zinf/schedule/keep.py,
zinf/host_room.py)."""

from __future__ import annotations

from zinf.host_room import keep_share
from zinf.plan.machine import Machine
from zinf.plan.model import ModelSpec
from zinf.plan.placements import PlanPlacement
from zinf.plan.workload import Workload

__all__ = ["gathered_peak", "keep_room", "kept_for_backward"]


def gathered_peak(spec: ModelSpec, wl: Workload, pb: int, pl: PlanPlacement, kept: list[bool], room: int) -> int:
    """Full parameters gathered at once (0 with one rank and device shards: gathered in place), the larger of two
    moments: the largest group (an embedding, often used again by a tied head) with the next ``prefetch_modules``
    groups gathered ahead, within ``prefetch_bytes``, beside what the host's ``room`` holds of the ``kept`` groups
    the forward ran before it; and the forward's end, where the kept groups (a suffix of the forward) are all
    gathered. With ``reshard_after_forward`` "never", the whole model at the forward's end."""
    if wl.world == 1 and pl.params == "device":
        return 0
    fulls = [n * wl.world * pb for n in spec.shard_numels(wl.world)]  # in the forward's order
    if wl.reshard_after_forward == "never":
        return sum(fulls)
    largest = max(range(len(fulls)), key=fulls.__getitem__)
    ahead = min(wl.prefetch_bytes, sum(sorted(fulls, reverse=True)[1 : 1 + wl.prefetch_modules]))
    kept_before = sum(f for f, k in zip(fulls[:largest], kept) if k)
    at_end = sum(f for f, k in zip(fulls, kept) if k)
    return max(fulls[largest] + ahead + min(room, kept_before), at_end)


def keep_room(machine: Machine, wl: Workload, pl: PlanPlacement, nbytes: dict[str, dict[str, int]]) -> int:
    """The engine's ``keep_room`` (zinf/host_room.py) from the machine's available memory less what every rank of
    the host keeps in it (its model states and pool; the device tier is host memory on a CPU), computing on the CPU
    where something is gathered."""
    if (machine.device != "cpu" or wl.host_keep != "auto" or wl.reshard_after_forward != "auto" or wl.max_cpu_bytes
            or (wl.world == 1 and pl.params == "device")):
        return 0
    ranks = max(1, wl.ranks_per_node)
    kept = sum(sum(nbytes.get(tier, {}).values()) for tier in ("device", "cpu"))  # host memory here: not the swap
    return keep_share(machine.host_bytes - ranks * kept, ranks)


def kept_for_backward(spec: ModelSpec, wl: Workload, pb: int, room: int) -> list[bool]:
    """Per group, whether the backward finds it still gathered from the forward, as the engine's BackwardKeep
    (zinf/schedule/keep.py) chooses with ``reshard_after_forward``: "always" none, "never" all, "auto" the groups
    the backward gathers first (the forward's last, here the groups in reverse) while their full bytes (at the
    compute width) fit ``prefetch_bytes`` and the host's ``room``, the last group (the output layer's: gathered as
    the forward ends) whatever its size. Those are gathered once a step instead of twice."""
    kept = [False] * len(spec.groups)
    if wl.world == 1 and not room or wl.reshard_after_forward == "always":
        return kept
    budget = wl.prefetch_bytes + room
    numels = spec.shard_numels(wl.world)
    for i in reversed(range(len(numels))):
        full = numels[i] * wl.world * pb
        if i == len(numels) - 1:
            kept[i] = True  # the running group at both ends of the backward's start: no room of the window taken
            continue
        if wl.reshard_after_forward != "never" and full > budget:
            break
        budget -= full
        kept[i] = True
    return kept
