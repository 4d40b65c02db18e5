"""Bytes of one placement's model states per tier, of the pinned pool its offload needs, and of its swap files.

Everything is per rank. ``Ps`` is this rank's shard numel summed over the groups (each group padded to a
multiple of the world size), ``pb`` the compute dtype's bytes (4 for fp32, 2 for bf16/fp16). A frozen group (no
parameter requires a gradient) costs its shard alone, at ``pb``: no master, gradient or optimizer state, no
optimizer sub-group or record, never rewritten or reduce-scattered (see [Note: frozen groups] in
zinf/param/master.py); the rest below counts the trainable groups' shards.
"""

from __future__ import annotations

from typing import Sequence

from zinf.config import PRECISIONS
from zinf.config_sections import TIERS
from zinf.offload.grad_stash import held_count
from zinf.offload.pool_room import block_bytes
from zinf.offload.subgroups import subgroup_numels
from zinf.offload.swap import align_up, record_span
from zinf.plan.model import ModelSpec
from zinf.plan.placements import PlanPlacement

__all__ = ["record_span", "trained_shards", "pool_need", "choose_pool", "state_bytes", "disk_bytes", "held_grad_bytes"]


def _subgroup_numels(shards: Sequence[int], sub_group_numel: int) -> list[int]:
    return [n for shard in shards for n in subgroup_numels(shard, sub_group_numel)]  # as plan_subgroups


def trained_shards(spec: ModelSpec, shards: Sequence[int]) -> list[int]:
    """The shards of the groups that train (frozen groups have no optimizer state, gradient or update)."""
    return [n for n, g in zip(shards, spec.groups) if g.trainable]


def held_grad_bytes(trained: Sequence[int], sub_group_numel: int, pool: int) -> int:
    """Gradient bytes a step neither writes to NVMe nor reads back: the sweep's first sub-groups' (of the ``trained``
    shards in the forward's order) while their blocks fit a quarter of the pool ([Note: gradients held for the step]
    in zinf/offload/grad_stash.py)."""
    numels = _subgroup_numels(trained, sub_group_numel)
    return 4 * sum(numels[: held_count([record_span(n * 4) for n in numels], pool)])


def pool_need(spec: ModelSpec, world: int, precision: str, pl: PlanPlacement, sub_group_numel: int) -> int:
    """What Placement._check_pool requires of offload.pinned_pool_bytes."""
    shards, pb = spec.shard_numels(world), PRECISIONS[precision].itemsize
    trained = trained_shards(spec, shards)
    sizes = spec.shard_bytes(world, pb)
    pipeline = 0
    if pl.optimizer == "nvme" and trained:
        numel = max(_subgroup_numels(trained, sub_group_numel))
        pipeline = 3 * sum(block_bytes(record_span(n)) for n in _record_bytes(pl, numel))
    return pipeline + param_reserve(spec, world, precision, pl) + (largest_block(sizes) if pl.params == "nvme" else 0)


def largest_block(sizes: Sequence[int]) -> int:
    """The pool blocks of the largest record of these byte sizes."""
    return block_bytes(max(record_span(n) for n in sizes)) if sizes else 0


def param_reserve(spec: ModelSpec, world: int, precision: str, pl: PlanPlacement) -> int:
    """The pool room the parameter store's read-ahead leaves free (Placement._check_pool): the largest shard once,
    the largest trained shard twice."""
    if pl.params != "nvme":
        return 0
    shards, pb = spec.shard_numels(world), PRECISIONS[precision].itemsize
    return largest_block(spec.shard_bytes(world, pb)) + 2 * largest_block([n * pb for n in trained_shards(spec, shards)])


def _record_bytes(pl: PlanPlacement, numel: int) -> list[int]:
    """The optimizer's records of a sub-group of ``numel``: master, moments (int8: and their exponents), and the
    gradient when it is on NVMe."""
    return [numel * 4, *pl.moment_records(numel)] + ([numel * 4] if pl.grads == "nvme" else [])


def choose_pool(need: int, param_span_bytes: int) -> int:
    """The pool the planner recommends: what the checks need, half again for read-ahead, and room to keep the
    parameter shards cached (up to 1 GiB), in 64 MiB steps, at least the engine's 256 MiB."""
    want = int(need * 1.5) + min(param_span_bytes, 1 << 30)
    return max(256 << 20, align_up(want, 64 << 20))


def state_bytes(spec: ModelSpec, world: int, precision: str, pl: PlanPlacement, machine_device: str,
                pool_bytes: int) -> dict[str, dict[str, int]]:
    """Bytes per tier and kind as ``engine.resident_bytes()`` reports them at their peak (gradient shards on
    NVMe counted while they are there)."""
    shards = spec.shard_numels(world)
    pb = PRECISIONS[precision].itemsize
    trainable = sum(trained_shards(spec, shards))
    sizes = spec.shard_bytes(world, pb)
    frozen = sum(b for b, g in zip(sizes, spec.groups) if not g.trainable)  # their shards alone
    out: dict[str, dict[str, int]] = {t: {} for t in TIERS}

    def add(tier: str, kind: str, n: int) -> None:
        if n:
            out[tier][kind] = out[tier].get(kind, 0) + n

    # fp32 with a device optimizer: a trainable group's shard is its master
    shared = pb == 4 and pl.optimizer == "device"
    if pl.params == "nvme":
        add("nvme", "param_shards", sum(record_span(b) for b in sizes))
    elif shared and (pl.params == "device" or machine_device == "cpu"):
        # the trainable shards are the masters' own tensors (the CPU store's too, without CUDA): counted below
        add(pl.params, "param_shards", frozen)
    else:
        add(pl.params, "param_shards", sum(sizes))
    if pl.optimizer == "device":
        add("device", "param_shards" if shared and pl.params == "device" else "master", trainable * 4)
        add("device", "optimizer_state", trainable * 8)
        add("device", "grad_shards", trainable * 4)
    else:
        # fp32 shards in host memory are the CPU-Adam's masters ([Note: one fp32 master on the host])
        host_master = pb == 4 and pl.optimizer == "cpu" and (pl.params == "cpu" or (pl.params == "device"
                                                                                    and machine_device == "cpu"))
        moments = pl.moments_nbytes(trainable)
        add(pl.optimizer, "optimizer_state", moments if host_master else 4 * trainable + moments)
        add(pl.grads, "grad_shards", trainable * 4)
    if "nvme" in (pl.params, pl.optimizer):
        add("cpu", "pinned_pool", pool_bytes)
    return out


def disk_bytes(spec: ModelSpec, world: int, precision: str, pl: PlanPlacement, sub_group_numel: int) -> int:
    shards, pb = spec.shard_numels(world), PRECISIONS[precision].itemsize
    total = sum(record_span(b) for b in spec.shard_bytes(world, pb)) if pl.params == "nvme" else 0
    if pl.optimizer == "nvme":
        total += sum(record_span(b) for n in _subgroup_numels(trained_shards(spec, shards), sub_group_numel)
                     for b in _record_bytes(pl, n))
    return total
