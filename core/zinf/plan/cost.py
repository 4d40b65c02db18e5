"""Bytes per tier and step time of one placement: the planner's model of the engine (see zinf/plan/__init__.py
for the model in words and the bytes per parameter).

Everything is per rank. ``Ps`` is this rank's shard numel summed over the groups (each group padded to a
multiple of the world size), ``pb`` the compute dtype's bytes (4 for fp32, 2 for bf16/fp16). A frozen group (no
parameter requires a gradient) costs its shard alone, at ``pb``: no master, gradient or optimizer state, no
optimizer sub-group or record, never rewritten or reduce-scattered (see [Note: frozen groups] in
zinf/param/master.py); the rest below counts the trainable groups' shards.

The model states' bytes are counted in zinf/plan/memory.py; this module adds the working set on the device, the
data moved per step and the time it takes, and checks what fits the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from zinf.config import PRECISIONS
from zinf.offload.device_states import groups_in_share
from zinf.offload.pool_room import block_bytes
from zinf.offload.nvme_state_store import READ_AHEAD_BYTES, READ_AHEAD_SUBGROUPS
from zinf.offload.subgroups import subgroup_numels
from zinf.plan.machine import Machine
from zinf.plan.memory import (choose_pool, disk_bytes, held_grad_bytes, param_reserve, pool_need, record_span,
                              state_bytes, trained_shards)
from zinf.plan.gathered import gathered_peak, keep_room, kept_for_backward
from zinf.plan.model import ModelSpec, PlanError
from zinf.plan.placements import PlanPlacement
from zinf.plan.workload import Workload

__all__ = ["Estimate", "estimate", "Workload", "Calibration"]


@dataclass(frozen=True)
class Calibration:
    """The model's constants, each with where it comes from (see the module docstring of zinf/plan)."""

    # bytes of host-copy time per parameter of a torch AdamW step over the shards plus the gradient zeroing (and
    # for bf16 the copy of the master into the shard): single-tensor AdamW on CPU makes ~8 passes (lerp,
    # mul+addcmul, sqrt, div, add, addcdiv, weight decay); measured here at 53-66 with one thread, so 80 with the
    # zeroing and copy
    torch_adam_bytes: float = 80.0
    # zinf's CPU-Adam moves 30-34 bytes per parameter (reads gradient, master, moments; writes master, moments,
    # shard; zeroes the gradient: docs/offload.md), but reads cost less than a copy's read + write: measured here
    # at 17-19 bytes of host-copy time per parameter (1 and 2 threads), so 20
    cpu_adam_bytes: float = 20.0
    # the same with bf16 moments (optimizer_storage: bf16, 22 bytes moved instead of 30) and with int8 ones (18, but
    # each block decoded and encoded): benchmarks/bench_cpu_adam.py, the engines' steps interleaved, measured them
    # 1.10-1.13x and 0.52-0.55x the fp32 step's speed here (100M parameters, 3 runs), so 20 / 1.12 and 20 / 0.53
    cpu_adam_bytes_bf16: float = 17.9
    cpu_adam_bytes_int8: float = 37.7
    # fp32 elements read + written per token per layer per hidden unit by the non-matmul work (norms, GELU,
    # residuals, attention softmax, copies), forward + backward; fitted to GPT runs on the 2-core machine of
    # docs/planner.md (noisy: a shared machine), not derived
    elementwise_per_layer: float = 100.0
    # per token per vocabulary entry (the fp32 logits, cross-entropy forward and backward, the tied head's
    # gradient), fitted the same way
    elementwise_per_vocab: float = 32.0
    # on CPU, bf16/fp16 element-wise kernels convert to fp32 and back: their time is this many times the fp32
    # estimate (fitted to the bf16 GPT run of docs/planner.md, which the fp32 constants under-predicted by ~30%)
    low_precision_elementwise_cpu: float = 3.0
    # the engine's own work per group per step (module hooks, gather and reduce bookkeeping in Python), seconds:
    # engine fwd+bwd minus plain PyTorch fwd+bwd of the same GPT, per group, on the same machine
    per_group_seconds: float = 1e-3
    # share of a stream's time hidden behind the longest one (docs/offload.md measured 75-93% of NVMe I/O hidden)
    hidden_fraction: float = 0.8
    # CRC32C of every offloaded record, read and written (bytes per second per core)
    crc_bw_per_core: float = 8e9


@dataclass
class Estimate:
    placement: PlanPlacement
    precision: str  # compute dtype
    storage: str  # the parameter shards' dtype at rest (param_storage); the precision unless set apart
    bytes: dict[str, dict[str, int]]  # tier -> kind -> bytes per rank (model states, pinned pool, estimates)
    disk_bytes: int  # swap files on NVMe per rank
    io_bytes: dict[str, int]  # per step per rank: nvme_read, nvme_write, h2d, d2h, allgather
    seconds: dict[str, float]  # compute, optimizer, nvme, pcie, allgather, step
    pinned_pool_bytes: int
    sub_group_numel: int
    why_not: list[str] = field(default_factory=list)  # what this placement lacks on this machine; empty: it fits
    device_fraction: float = 0.0  # offload.optimizer_device_fraction the planner picks (see ``device_share``)

    @property
    def fits(self) -> bool:
        return not self.why_not

    def tier_bytes(self, tier: str, states_only: bool = False) -> int:
        kinds = self.bytes.get(tier, {})
        return sum(v for k, v in kinds.items() if not states_only or k in _STATE_KINDS)


_STATE_KINDS = ("param_shards", "master", "grad_shards", "optimizer_state", "pinned_pool")


def _activation_bytes(spec: ModelSpec, wl: Workload, pb: int) -> int:
    """A rough activation estimate (not checked against runs): 17 compute-dtype values per hidden unit per token
    per layer with fused attention, the logits in fp32 three times; with checkpointing the block inputs only,
    plus one block recomputed."""
    h, layers, vocab = spec.hidden or 0, spec.num_layers or 0, spec.vocab or 0
    per_layer = wl.batch_tokens * h * 17 * pb
    blocks = layers * wl.batch_tokens * h * pb + per_layer if wl.checkpointing else layers * per_layer
    return blocks + wl.batch_tokens * vocab * 4 * 3


def state_reads_in_flight(largest_subgroup: int) -> int:
    """The optimizer's state reads in flight during its sweep ([Note: the sweep's reads] in
    zinf/offload/nvme_state_store.py), at most: three of the largest sub-groups' fp32 master and moments, or
    READ_AHEAD_BYTES if more."""
    return max(READ_AHEAD_BYTES, READ_AHEAD_SUBGROUPS * 3 * block_bytes(record_span(largest_subgroup * 4)))


def estimate(spec: ModelSpec, machine: Machine, wl: Workload, pl: PlanPlacement, precision: str,
             nvme_paths: Sequence[str] = (), cal: Calibration = Calibration(), storage: str | None = None) -> Estimate:
    """Bytes and step time of one placement: compute in ``precision``, parameter shards kept, read and all-gathered
    in ``storage`` (default: the precision)."""
    storage = storage or precision
    for name, value in (("precision", precision), ("storage", storage)):
        if value not in PRECISIONS:
            raise PlanError(f"zinf plan: {name} {value!r} is not one of {sorted(PRECISIONS)}.")
    pb, sb = PRECISIONS[precision].itemsize, PRECISIONS[storage].itemsize
    world, ranks = wl.world, max(1, wl.ranks_per_node)
    shards = spec.shard_numels(world)
    trainable = sum(trained_shards(spec, shards))
    uses_nvme = "nvme" in (pl.params, pl.optimizer)
    need = pool_need(spec, world, storage, pl, wl.sub_group_numel) if uses_nvme else 0
    sizes = spec.shard_bytes(world, sb)  # the shards at rest: storage-dtype elements, or 4-bit codes and scales
    param_spans = sum(record_span(b) for b in sizes)
    pool = (wl.pinned_pool_bytes or choose_pool(need, param_spans if pl.params == "nvme" else 0)) if uses_nvme else 0
    nbytes = state_bytes(spec, world, storage, pl, machine.device, pool)
    acts = _activation_bytes(spec, wl, pb)
    room = keep_room(machine, wl, pl, nbytes)
    kept = kept_for_backward(spec, wl, pb, room)
    gathered = gathered_peak(spec, wl, pb, pl, kept, room)
    if gathered:
        nbytes["device"]["gathered_peak"] = gathered
    if acts:
        nbytes["device"]["activations_estimate"] = acts
    disk = disk_bytes(spec, world, storage, pl, wl.sub_group_numel) if uses_nvme else 0

    # -- data moved per step -------------------------------------------------------------------------
    io = {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0, "allgather": 0, "reduce_scatter": 0}
    if pl.params == "nvme":
        # the pool keeps shards for the backward and updated shards for the next forward (NvmeShardStore);
        # what it cannot keep is read in the forward and again in the backward
        # the pool less the parameter store's reserve (the largest shard, the largest trained one twice) and the
        # optimizer's reads in flight
        cache = max(0, pool - param_reserve(spec, world, storage, pl)
                    - (state_reads_in_flight(max(subgroup_numels(max(shards), wl.sub_group_numel)))
                       if pl.optimizer == "nvme" else 0))
        # the backward reads neither what the pool kept nor the groups kept gathered, both the forward's last
        kept_spans = sum(record_span(b) for b, k in zip(sizes, kept) if k)
        io["nvme_read"] += max(0, param_spans - cache) + max(0, param_spans - max(cache, kept_spans))
        io["nvme_write"] += sum(record_span(n * sb) for n in trained_shards(spec, shards))  # frozen shards are never rewritten
    if pl.optimizer == "nvme":
        io["nvme_read"] += trainable * 4 + pl.moments_nbytes(trainable)
        io["nvme_write"] += trainable * 4 + pl.moments_nbytes(trainable)
        if pl.grads == "nvme":
            io["nvme_read"] += trainable * 4
            io["nvme_write"] += trainable * 4
    if machine.device == "cuda":  # pragma: no cover - CUDA only
        if pl.params != "device":
            io["h2d"] += 2 * sum(sizes)
        if pl.optimizer != "device":
            io["d2h"] += trainable * 4
    if world > 1:
        # received per rank: the forward's gathers and the backward's, less the groups kept from one to the other
        io["allgather"] = (world - 1) * (2 * sum(sizes) - sum(b for b, k in zip(sizes, kept) if k))
        io["reduce_scatter"] = (world - 1) * trainable * 4

    # -- time per step ---------------------------------------------------------------------------------
    cpu = machine.device == "cpu"
    share = ranks if cpu else 1  # ranks on one CPU machine share its cores and memory bandwidth
    flops = machine.flops_for(precision) * (machine.cpu_share(ranks) if cpu else 1.0)
    tokens = wl.batch_tokens
    recompute = 4 / 3 if wl.checkpointing else 1.0  # one more forward: 8 instead of 6 flops per parameter
    # a frozen group's weights get no gradient: its products cost 4 flops a parameter a token, not 6 (LoRA's base)
    frozen = sum(g.numel for g in spec.groups if g.matmul and not g.trainable)
    matmul_flops = ((6 * spec.matmul_numel - 2 * frozen) * tokens
                    + 6 * (spec.num_layers or 0) * wl.seq_len * (spec.hidden or 0) * tokens) * recompute
    mem_bw = machine.device_bw / share
    host_bw = machine.host_bw / ranks
    elementwise = tokens * ((spec.num_layers or 0) * (spec.hidden or 0) * cal.elementwise_per_layer * recompute
                            + (spec.vocab or 0) * cal.elementwise_per_vocab) * 4
    sec: dict[str, float] = {}
    if cpu and pb < 4:
        elementwise *= cal.low_precision_elementwise_cpu
    sec["compute"] = matmul_flops / flops + elementwise / mem_bw + len(spec.groups) * cal.per_group_seconds
    if pl.optimizer == "device":
        sec["optimizer"] = trainable * cal.torch_adam_bytes / mem_bw
    else:
        per = {"fp32": cal.cpu_adam_bytes, "bf16": cal.cpu_adam_bytes_bf16, "int8": cal.cpu_adam_bytes_int8}[pl.moments]
        sec["optimizer"] = trainable * per / host_bw
    fraction, shared_groups = 0.0, 0
    if machine.device == "cuda" and pl.optimizer != "device" and pl.params == "device":
        headroom = int(machine.device_bytes * 0.9) - sum(nbytes["device"].values())
        trained = trained_shards(spec, shards)
        fraction = device_share(sec["optimizer"], sec["compute"] / (3 * recompute), trained, headroom)
        if fraction:
            moved = share_taken(trained, fraction)  # whole groups, as the engine takes them
            shared_groups = groups_in_share(trained, fraction)
            _move_share(nbytes, pl, trainable, moved)
            sec["optimizer_device"] = moved * trainable * cal.torch_adam_bytes / mem_bw
            sec["optimizer"] *= 1 - moved
            io["d2h"] -= int(moved * trainable * 4)  # its gradients stay on the device
            if pl.optimizer == "nvme":  # its states (and gradients) are neither read nor written there
                states = trainable * 4 + pl.moments_nbytes(trainable) + (trainable * 4 if pl.grads == "nvme" else 0)
                for key in ("nvme_read", "nvme_write"):
                    io[key] -= int(moved * states)
                disk -= int(moved * states)
    if pl.optimizer == "nvme" and pl.grads == "nvme":  # the CPU sweep's first gradients stay in the pool
        held = held_grad_bytes(trained_shards(spec, shards)[shared_groups:], wl.sub_group_numel, pool)
        io["nvme_read"] -= held
        io["nvme_write"] -= held
    nvme_bytes = io["nvme_read"] + io["nvme_write"]
    if nvme_bytes:
        read_bw, write_bw, mixed_bw = _disk_bw(machine, nvme_paths)
        # reads and writes overlap (prefetch, trailing writes): the disk's rate for both at once when it was
        # measured, else one after the other
        apart = io["nvme_read"] / read_bw + io["nvme_write"] / write_bw
        together = max(io["nvme_read"] / read_bw, io["nvme_write"] / write_bw, nvme_bytes / mixed_bw) if mixed_bw else apart
        sec["nvme"] = together * ranks
        sec["checksum"] = nvme_bytes / (cal.crc_bw_per_core * max(1.0, machine.cores / share))
    if io["h2d"] or io["d2h"]:  # pragma: no cover - CUDA only
        sec["pcie"] = (io["h2d"] + io["d2h"]) / (machine.h2d_bw or 12e9)
    if world > 1:
        bw = machine.allgather_bw or 0.0
        # per group a gather in forward and in backward (one if kept) and its share of a reduce-scatter
        fixed = (3 * len(spec.groups) - sum(kept)) * machine.collective_latency
        sec["allgather"] = (io["allgather"] + io["reduce_scatter"]) / bw + fixed if bw else float("nan")
    # streams: on CPU the compute, the CPU-Adam, the checksums and gloo share the cores (they add up); the disk
    # is a stream of its own. With CUDA the CPU-Adam runs beside the next forward (a third of the compute).
    if cpu:
        streams = [sec["compute"] + sec["optimizer"] + sec.get("checksum", 0.0) + _finite(sec.get("allgather", 0.0)),
                   sec.get("nvme", 0.0)]
    else:  # pragma: no cover - CUDA only
        opt_visible = sec["optimizer"] if pl.optimizer == "device" else \
            sec.get("optimizer_device", 0.0) + max(0.0, sec["optimizer"] - sec["compute"] / (3 * recompute))
        streams = [sec["compute"] + opt_visible, sec.get("nvme", 0.0) + sec.get("checksum", 0.0),
                   sec.get("pcie", 0.0), _finite(sec.get("allgather", 0.0))]
    streams = [_finite(x) for x in streams]
    longest = max(streams)
    sec["step"] = longest + (1 - cal.hidden_fraction) * (sum(streams) - longest)
    if (world > 1 and not machine.allgather_bw) or sec.get("nvme", 0.0) != sec.get("nvme", 0.0):
        sec["step"] = float("nan")  # a bandwidth it needs is unknown
    est = Estimate(pl, precision, storage, nbytes, disk, io, sec, pool, wl.sub_group_numel, device_fraction=fraction)
    _check_fit(est, spec, machine, wl, nvme_paths)
    return est


SHARE_STEP = 0.05  # the device shares the planner picks from
SHARE_BYTES = 16  # device bytes per parameter of the share: fp32 master and moments, and its gradient shard


def device_share(cpu_adam_s: float, forward_s: float, trained: Sequence[int], headroom_bytes: int) -> float:
    """The share of the optimizer to keep on the device ([Note: the device share] in zinf/offload/device_states.py):
    the CPU-Adam runs beside the next forward, so the step waits for ``cpu_adam_s x (1 - f) - forward_s`` plus the
    device's own step of the share (tens of times faster); the smallest ``f`` that hides the rest behind the forward,
    within the device memory left (``SHARE_BYTES`` a parameter), in steps of ``SHARE_STEP`` (0: none needed or no
    room). ``trained``: the trained groups' shard sizes in build order; the share the engine takes of a fraction is
    whole groups (:func:`share_taken`), so that is what must fit and what must hide the rest."""
    total = sum(trained)
    if cpu_adam_s <= forward_s or total <= 0 or headroom_bytes <= 0:
        return 0.0
    wanted = 1.0 - forward_s / cpu_adam_s
    room = headroom_bytes / (SHARE_BYTES * total)
    last = round(1.0 / SHARE_STEP) - 1  # never the whole optimizer
    best = 0
    for steps in range(1, last + 1):
        taken = share_taken(trained, steps * SHARE_STEP)
        if taken > room:
            break
        best = steps
        if taken >= wanted - 1e-9:
            break
    return round(best * SHARE_STEP, 2)


def share_taken(trained: Sequence[int], fraction: float) -> float:
    """The share of ``trained`` (shard sizes in build order) the engine keeps on the device for ``fraction``."""
    total = sum(trained)
    return sum(trained[: groups_in_share(trained, fraction)]) / total if total else 0.0


def _move_share(nbytes: dict[str, dict[str, int]], pl: PlanPlacement, trainable: int, fraction: float) -> None:
    """The share's master, moments and gradients leave the host (or NVMe) tiers for the device, in fp32."""
    numel = int(fraction * trainable)
    host_states = nbytes[pl.optimizer].get("optimizer_state", 0)
    nbytes[pl.optimizer]["optimizer_state"] = host_states - int(host_states * fraction)
    grads = nbytes[pl.grads].get("grad_shards", 0)
    nbytes[pl.grads]["grad_shards"] = grads - int(grads * fraction)
    device = nbytes["device"]
    device["optimizer_state"] = device.get("optimizer_state", 0) + 12 * numel
    device["grad_shards"] = device.get("grad_shards", 0) + 4 * numel


def _finite(x: float) -> float:
    return 0.0 if x != x else x


def _disk_bw(machine: Machine, paths: Sequence[str]) -> tuple[float, float, float]:
    """Offload files are striped over the paths: their bandwidths add up, one per file system (mixed: 0 when
    not measured for every path)."""
    if not paths:
        nan = float("nan")
        return nan, nan, nan  # no drive: the time is unknown (and the placement does not fit)
    read = write = mixed = 0.0
    for dev, group in _by_filesystem(paths).items():
        read += min(machine.disk_read_bw.get(p, 0.0) for p in group) or 0.0
        write += min(machine.disk_write_bw.get(p, 0.0) for p in group) or 0.0
        mixed += min(machine.disk_mixed_bw.get(p, 0.0) for p in group) or 0.0
    if any(p not in machine.disk_mixed_bw for p in paths):
        mixed = 0.0
    if not read or not write:
        raise PlanError("zinf plan: no disk bandwidth for the --nvme paths; measure them (drop the Machine given) or "
                        "fill Machine.disk_read_bw / disk_write_bw.")
    return read, write, mixed


def _by_filesystem(paths: Sequence[str]) -> dict[object, list[str]]:
    out: dict[object, list[str]] = {}
    for p in paths:
        key: object = os.stat(p).st_dev if os.path.exists(p) else p
        out.setdefault(key, []).append(p)
    return out


def _check_fit(est: Estimate, spec: ModelSpec, machine: Machine, wl: Workload, paths: Sequence[str]) -> None:
    ranks = max(1, wl.ranks_per_node)
    gib = 2**30
    dev = est.tier_bytes("device")
    cpu = est.tier_bytes("cpu")
    if machine.device == "cuda":  # pragma: no cover - CUDA only
        cap = int(machine.device_bytes * 0.9)  # the caching allocator's fragmentation and the CUDA context
        if dev > cap:
            est.why_not.append(f"device: needs {dev / gib:.2f} GiB per GPU, has {cap / gib:.2f} GiB (90% of it)")
        host_need = cpu * ranks
    else:
        host_need = (cpu + dev) * ranks
    host_cap = wl.max_cpu_bytes or machine.host_bytes
    if host_need > host_cap:
        est.why_not.append(f"host memory: needs {host_need / gib:.2f} GiB for {ranks} rank(s), "
                           f"{'max_cpu_bytes allows' if wl.max_cpu_bytes else 'available'} {host_cap / gib:.2f} GiB")
    if est.disk_bytes:
        if not paths:
            est.why_not.append("nvme: no --nvme path given")
        else:
            free = sum(machine.nvme_free_bytes.get(g[0], 0) for g in _by_filesystem(paths).values())
            need = est.disk_bytes * ranks
            if need > free:
                est.why_not.append(f"nvme: needs {need / gib:.2f} GiB of swap files, {free / gib:.2f} GiB free")
