"""``zinf plan``: for a model, a world size and this machine, the bytes per rank on device, CPU and NVMe of
every placement, which placements fit, a predicted step time from bandwidths measured here, and the
recommended placement with its config.

    import zinf.plan
    p = zinf.plan.plan(params=1.3e9, layers=24, hidden=2048, nvme_paths=["/mnt/nvme"])
    print(p.table()); print(p.yaml())

[Note: the planner's model]
Bytes per parameter of this rank's shard (``Ps`` parameters: each group padded to a multiple of the world size
and divided by it; ``pb`` = 4 for fp32, 2 for bf16/fp16), as ``engine.resident_bytes()`` counts them:

    placement (params/optimizer)   where the bytes are                                         bytes/param
    device/device, fp32            device: shard = master 4, grad 4, Adam moments 8              16
    device/device, bf16            device: shard 2, master 4, grad 4, moments 8                  18
    device/cpu                     device: shard pb (fp32: 4) | cpu: master+moments 12, grad 4   pb | 16
                                   (fp32 on a CPU-only machine: the shard is the master, cpu 16 in all)
    cpu/cpu                        cpu: shard pb, master+moments 12, grad 4                      pb + 16
                                   (fp32: the shard is the master, 16)
    nvme/nvme (grads nvme)         nvme: shard pb (in 4 KiB-aligned records), states 12, grad 4  pb + 16
                                   + cpu: the pinned pool (offload.pinned_pool_bytes)
    nvme/nvme/cpu                  nvme: shard pb, states 12 | cpu: grad 4 + pool
    x/y+bf16 (y = cpu or nvme)     as x/y with the moments 2 + 2 (``optimizer_storage: bf16``): states 8 (4 with
                                   the host master shared); +int8: 1 + 1 and an exponent byte per 256 of each
    x/device with x = cpu or nvme  device: master 4, grad 4, moments 8 | x: shard pb (with fp32 on a CPU-only
                                   machine the CPU store keeps the master's own tensor: no second copy)
    any, a frozen group            its shard pb on the parameters' tier, nothing else (no master,   pb
    (no parameter trains)          gradient, moments or optimizer records; never rewritten or
                                   reduce-scattered: [Note: frozen groups] in zinf/param/master.py)

Not model state, reported apart and not checked: the full parameters gathered at once (with several ranks, or
offloaded shards: about ``overlap.prefetch_bytes`` + 2 x the largest group) and an activation estimate (17
compute-dtype values per hidden unit per token per layer, fp32 logits three times; with checkpointing the
block inputs only).

Data moved per step and rank:

- compute: ``6 x params x tokens`` matmul FLOPs (``8 x`` with activation checkpointing: one more forward), plus
  ``6 x layers x seq x hidden x tokens`` for causal attention, at the FLOP/s of a matrix product of the model's
  shape (tokens x hidden @ hidden x 4 hidden) measured here; plus the element-wise work (norms, activations,
  softmax, the fp32 loss) as bytes at the device's memory bandwidth, plus the engine's own work per group (hooks
  and bookkeeping). The constants are in :class:`zinf.plan.cost.Calibration`, each with where it comes from.
- optimizer: torch AdamW over device shards ~80 bytes/param, zinf's CPU-Adam ~20 (it moves 30-34 bytes per
  parameter, docs/offload.md, but reads cost less than a copy; ~17.9 with bf16 moments, ~37.7 with int8 ones), both
  in host-copy time at the measured bandwidth. With CUDA, the parameters on the device and the optimizer offloaded,
  the planner keeps the share of the optimizer on the device (``optimizer_device_fraction``) that hides the rest of
  the CPU-Adam behind the next forward, where the device's memory allows (``cost.device_share``): its states and
  gradients move to the device (16 bytes a parameter), its step at torch AdamW's rate adds to the step.
- NVMe: parameters are read in the forward and again in the backward (the paper's ``2 x pb``), less what the
  pinned pool keeps (the engine keeps forward shards for the backward and updated shards for the next forward
  while there is room: the pool less its reserve, the largest shard and twice the largest trained one, and the
  optimizer's read-ahead), and written once
  (``pb``, in their 4 KiB records); optimizer states read and written once (12 + 12); gradients on NVMe written in
  backward and read by the step (4 + 4). Reads and writes overlap (read-ahead, trailing writes), so the disk time
  is the larger of reads at the read rate, writes at the write rate, and both at the rate measured for reads and
  writes at once; plus the CRC32C of every record (CPU time).
- with CUDA: offloaded parameter shards cross PCIe twice (``2 x pb``), offloaded gradients once (4).
- with several ranks: all-gather ``2 x (world - 1) x pb`` received, reduce-scatter ``(world - 1) x 4`` sent, at the
  all-gather bandwidth, plus a fixed cost per collective (three per group per step).

Overlap, as the engine achieves it: streams that run side by side cost ``max(streams) + (1 - h) x (the
rest)``, with ``h`` = 0.8 hidden (docs/offload.md measured 75-93% of the NVMe I/O hidden behind compute). NVMe
reads are prefetched and writes trail, so the disk is its own stream. On a CPU-only machine compute, CPU-Adam,
checksums and gloo collectives share the cores and add up; with CUDA the background CPU-Adam overlaps the next
forward (a third of the compute) and PCIe and NCCL run beside compute. Ranks on one machine share its host
memory bandwidth and disks, and on CPU its cores (each rank is assumed to run as many threads as the
measurement did).

Recommendation: the fastest placement that fits (device memory, host RAM available now, free space at the NVMe
paths); among those within 5% of it, the one with the fewest offloads (CPU counts 1, NVMe 2).

How well this predicts real runs: docs/planner.md (benchmarks/plan_check.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import nn

from zinf.plan.cost import Calibration, Estimate, Workload, estimate
from zinf.plan.frozen_base import FrozenBase, choose_frozen_base
from zinf.plan.placements import ALL_PLACEMENTS, PlanPlacement, parse_placement
from zinf.plan.machine import Machine, measure_machine
from zinf.plan.model import (QLORA_BITS, ModelSpec, PlanError, check_at_least, spec_from_factory, spec_from_hf,
                             spec_from_module, spec_from_params)

__all__ = ["plan", "Plan", "Machine", "measure_machine", "ModelSpec", "PlanError", "PlanPlacement", "Estimate",
           "Workload", "Calibration", "ALL_PLACEMENTS", "parse_placement", "model_spec", "TIE_TOLERANCE"]

TIE_TOLERANCE = 0.05  # placements within 5% of the fastest count as a tie


@dataclass
class Plan:
    model: ModelSpec
    machine: Machine
    workload: Workload
    nvme_paths: list[str]
    estimates: list[Estimate]
    recommended: Estimate | None
    notes: list[str] = field(default_factory=list)
    frozen_base: FrozenBase | None = None  # [Note: in place or staged] in zinf/plan/frozen_base.py

    def config(self, est: Estimate | None = None) -> dict[str, Any]:
        """The ``zinf:`` section (a ZeroConfig dict) for ``est`` (default: the recommended placement)."""
        est = est or self.recommended
        if est is None:
            raise PlanError(f"zinf plan: {self._why_none()}")
        cfg: dict[str, Any] = {"precision": est.precision, "offload": est.placement.offload_config()}
        if est.storage != est.precision:
            cfg["param_storage"] = est.storage
        if est.placement.moments != "fp32":
            cfg["optimizer_storage"] = est.placement.moments
        if est.device_fraction:
            cfg["offload"]["optimizer_device_fraction"] = est.device_fraction
        if "nvme" in (est.placement.params, est.placement.optimizer):
            cfg["offload"].update(nvme_paths=list(self.nvme_paths), pinned_pool_bytes=est.pinned_pool_bytes,
                                  sub_group_numel=est.sub_group_numel)
        if self.frozen_base is not None and est.placement.params == "nvme":
            cfg["offload"]["frozen_in_place"] = self.frozen_base.in_place
        if self.workload.checkpointing:
            cfg["activation_checkpointing"] = {"modules": ["<your block class, e.g. Block>"]}
        return cfg

    def _why_none(self) -> str:
        """Why nothing is recommended: no placement fits, or those that fit have no step time (a speed unknown)."""
        if any(e.fits for e in self.estimates) and self.workload.world > 1 and not self.machine.allgather_bw:
            known = self.machine.allgather_source
            why = "the machine was described for one rank" if known.startswith("not needed") else known
            return (f"placements fit, but their step time is unknown: the all-gather speed of {self.workload.world} "
                    f"ranks is not known ({why}); give it with --allgather-gbps (GB/s per rank) to compare them and "
                    "get a recommendation.")
        return "no placement fits: use more ranks, a larger NVMe path, or a smaller batch; the table says what each lacks."

    def yaml(self, est: Estimate | None = None) -> str:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml({"zinf": self.config(est)})

    def to_dict(self) -> dict[str, Any]:
        def row(e: Estimate) -> dict[str, Any]:
            return {"placement": e.placement.name, "params": e.placement.params, "optimizer": e.placement.optimizer,
                    "grads": e.placement.grads, "precision": e.precision, "param_storage": e.storage,
                    "optimizer_storage": e.placement.moments, "optimizer_device_fraction": e.device_fraction,
                    "bytes": {t: dict(k) for t, k in e.bytes.items()},
                    "bytes_per_tier": {t: e.tier_bytes(t) for t in e.bytes},
                    "disk_bytes": e.disk_bytes, "io_bytes": dict(e.io_bytes),
                    "seconds": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in e.seconds.items()},
                    "pinned_pool_bytes": e.pinned_pool_bytes, "fits": e.fits, "why_not": list(e.why_not)}

        rec = self.recommended
        return {
            "model": {"source": self.model.source, "params": self.model.numel, "groups": len(self.model.groups),
                      "layers": self.model.num_layers, "hidden": self.model.hidden, "seq_len": self.model.seq_len,
                      "vocab": self.model.vocab},
            "workload": vars(self.workload).copy(),
            "machine": self.machine.to_dict(),
            "placements": [row(e) for e in self.estimates],
            "recommended": None if rec is None else {**row(rec), "config": {"zinf": self.config(rec)}},
            "notes": list(self.notes),
            "frozen_base": None if self.frozen_base is None else self.frozen_base.to_dict(),
        }

    def json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self) -> str:
        m, wl = self.machine, self.workload
        gib = 2**30
        lines = [f"model: {self.model.describe()}",
                 f"workload: world {wl.world} ({wl.ranks_per_node} per machine), {wl.batch_tokens} tokens per rank per "
                 f"step, seq {wl.seq_len}{', activation checkpointing' if wl.checkpointing else ''}",
                 f"machine: {m.device_name}; device {m.device_bytes / gib:.1f} GiB, host RAM available "
                 f"{m.host_bytes / gib:.1f} GiB" + "".join(f", {p}: {f / gib:.0f} GiB free" for p, f in m.nvme_free_bytes.items()),
                 "measured: " + ", ".join([f"{k} matmul {_gflops(v)}" for k, v in m.flops.items()]
                                          + [f"host copy {m.host_bw / 1e9:.1f} GB/s"]
                                          + [f"disk {p} read {m.disk_read_bw[p] / 1e9:.2f} / write "
                                             f"{m.disk_write_bw[p] / 1e9:.2f} GB/s" for p in m.disk_read_bw]
                                          + ([f"H2D {m.h2d_bw / 1e9:.1f} GB/s"] if m.h2d_bw else [])),
                 f"all-gather: {m.allgather_source}" + (f" ({m.allgather_bw / 1e9:.2f} GB/s)" if m.allgather_bw else "")]
        lines += [f"note: {n}" for n in list(self.model.notes) + m.notes + self.notes]
        if self.frozen_base is not None:
            lines.append(f"frozen base: {self.frozen_base.describe()}")
        lines.append("")
        head = ["placement", "compute/storage", "device GiB", "cpu GiB", "nvme GiB", "moved GiB", "compute s",
                "optim s", "nvme s", "step s"]
        rows = []
        for e in self.estimates:
            s = e.seconds
            mark = "  <- recommended" if e is self.recommended else ""
            fits = "yes" if e.fits else "no: " + "; ".join(e.why_not)
            name = e.placement.name + (f" ({e.device_fraction:.2f} on device)" if e.device_fraction else "")
            rows.append([name, f"{e.precision}/{e.storage}", _num(e.tier_bytes("device") / gib),
                         _num(e.tier_bytes("cpu") / gib), _num(e.tier_bytes("nvme") / gib),
                         _num(sum(e.io_bytes.values()) / gib), _num(s["compute"]), _num(s["optimizer"]),
                         _num(s.get("nvme", 0.0)), _num(s["step"]), f"{fits}{mark}"])
        widths = [max(len(str(c)) for c in col) for col in zip(head + [""], *rows)]
        line = lambda cells: "  ".join(str(c).ljust(w) if i < 2 or i == len(widths) - 1 else str(c).rjust(w)  # noqa: E731
                                       for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        lines += [line(head + ["fits"]), "-" * len(line(head + ["fits"]))]
        lines += [line(r) for r in rows]
        lines.append("")
        lines.append("device GiB includes the gathered parameters' peak and an activation estimate; "
                     "nvme GiB counts the states' bytes (swap files add 4 KiB alignment per record); moved GiB is what "
                     "one step reads and writes on NVMe, copies to the device and all-gathers, per rank.")
        if self.recommended is None:
            lines.append(self._why_none())
        else:
            rec = self.recommended
            lines += ["", f"recommended: {rec.placement.name} (compute {rec.precision}, parameters stored in "
                          f"{rec.storage}), predicted step {_num(rec.seconds['step'])} s", "", self.yaml().rstrip()]
        return "\n".join(lines)


def _num(x: float) -> str:
    """A figure for the table: three decimals while small, thousands separators or an exponent when large."""
    if x != x:
        return "n/a"
    if abs(x) < 1000:
        return f"{x:.3f}"
    return f"{x:,.0f}" if abs(x) < 1e9 else f"{x:.3g}"


def _gflops(flops: float) -> str:
    """A matmul rate in GFLOP/s with three significant figures (a slow bf16 shows as 0.31, never as 0)."""
    return f"{flops / 1e9:.3g} GFLOP/s"


SLOW_16BIT_FACTOR = 2.0  # a 16-bit compute rate below fp32's / this: compute in fp32 and store 16-bit instead


def slow_16bit(machine: Machine, precisions: Sequence[str]) -> dict[str, str]:
    """Each requested 16-bit precision that this machine computes far slower than fp32 (a CPU without native bf16
    or fp16 units), with the note that says so."""
    fp32 = machine.flops.get("fp32")
    out = {}
    for p in precisions:
        rate = machine.flops.get(p)
        if p != "fp32" and fp32 and rate is not None and rate * SLOW_16BIT_FACTOR < fp32:
            out[p] = (f"{p} matmul measured {_gflops(rate)} against fp32's {_gflops(fp32)} ({fp32 / max(rate, 1.0):,.0f}x "
                      f"slower): this {machine.device.upper()} has no native {p} units. Compute in fp32 and keep the "
                      f"parameters in {p} (precision: fp32, param_storage: {p}); those rows are added below.")
    return out


def model_spec(model: Any = None, *, params: float | None = None, layers: int | None = None, hidden: int | None = None,
               vocab: int | None = None, hf_config: Any = None, hf_kwargs: dict | None = None, module: str | None = None,
               module_kwargs: dict | str | None = None, seq_len: int | None = None,
               qlora: bool | str = False) -> ModelSpec:
    """A :class:`ModelSpec` from exactly one of: ``model`` (an nn.Module, a ModelSpec or a transformers config),
    ``params`` (with optional ``layers``/``hidden``), ``hf_config`` (a model type or config), ``module``
    (``"package.module:factory"``). ``qlora`` (transformers models only; True or "4bit", or "8bit"): the base
    frozen, its linear layers in 4 or 8 bits, as ``from_pretrained(quantization_config=BitsAndBytesConfig(
    load_in_4bit=True))`` (or ``load_in_8bit=True``) loads them."""
    given = [name for name, v in (("model", model), ("params", params), ("hf_config", hf_config), ("module", module))
             if v is not None]
    if len(given) != 1:
        raise PlanError("zinf plan: give exactly one model: --params N [--layers L --hidden H], --hf-config TYPE "
                        f"[--hf-kwargs JSON], or --module pkg.mod:factory (found {given or 'none'}).")
    check_at_least(1, **{"--layers": layers, "--hidden": hidden, "--vocab": vocab, "--seq": seq_len})
    qlora = "4bit" if qlora is True else qlora or None
    if qlora is not None and qlora not in QLORA_BITS:
        raise PlanError(f"zinf plan: --qlora {qlora}: give one of {sorted(QLORA_BITS)}.")
    if qlora and hf_config is None and (model is None or isinstance(model, (nn.Module, ModelSpec))):
        raise PlanError("zinf plan: --qlora plans a transformers model's quantized base; give it with --hf-config TYPE.")
    if params is not None:
        return spec_from_params(params, layers, hidden, vocab, seq_len)
    if hf_config is not None:
        spec = spec_from_hf(hf_config, hf_kwargs, seq_len, qlora=qlora)
    elif module is not None:
        spec = spec_from_factory(module, module_kwargs, seq_len)
    elif isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, nn.Module):
        spec = spec_from_module(model, seq_len=seq_len)
    else:
        spec = spec_from_hf(model, None, seq_len, qlora=qlora)
    if layers or hidden or vocab:  # shapes the caller knows better than the heuristics
        spec = ModelSpec(spec.groups, spec.source, layers or spec.num_layers, hidden or spec.hidden, spec.seq_len,
                         vocab or spec.vocab, spec.notes)
    return spec


def plan(model: Any = None, *, params: float | None = None, layers: int | None = None, hidden: int | None = None,
         vocab: int | None = None, hf_config: Any = None, hf_kwargs: dict | None = None, module: str | None = None,
         module_kwargs: dict | str | None = None, world: int = 1, precision: str | Sequence[str] = "fp32",
         nvme_paths: Sequence[str] = (), batch_tokens: int = 2048, seq_len: int | None = None,
         checkpointing: bool = False, placements: Sequence[str | PlanPlacement] | None = None,
         machine: Machine | None = None, remeasure: bool = False, ranks_per_node: int | None = None,
         pinned_pool_bytes: int | None = None, sub_group_numel: int = 8 << 20, max_cpu_bytes: int = 0,
         allgather_gbps: float | None = None, reshard_after_forward: str = "auto", host_keep: str = "auto",
         calibration: Calibration = Calibration(), qlora: bool | str = False, checkpoint: str | None = None) -> Plan:
    """Estimate every placement (or those in ``placements``, ``"params/optimizer[/grads]"``) in each precision of
    ``precision`` for the model (see :func:`model_spec`), and recommend one. ``machine`` skips the measurements
    (tests inject one); otherwise this machine is measured (a few seconds, disks cached). ``checkpoint``: the
    directory of a pretrained base that stays frozen, to choose whether it is read in place or staged to swap
    ([Note: in place or staged] in zinf/plan/frozen_base.py)."""
    if world < 1:
        raise PlanError(f"zinf plan: --world = {world} is not allowed; expected a number of ranks >= 1.")
    if batch_tokens < 1:
        raise PlanError(f"zinf plan: --batch-tokens = {batch_tokens} is not allowed; expected tokens per rank per step >= 1.")
    check_at_least(1, **{"--seq": seq_len, "--ranks-per-node": ranks_per_node, "sub_group_numel": sub_group_numel})
    check_at_least(0, **{"--pinned-pool-bytes": pinned_pool_bytes, "--max-cpu-bytes": max_cpu_bytes})
    if allgather_gbps is not None and not (math.isfinite(allgather_gbps) and allgather_gbps > 0):
        raise PlanError(f"zinf plan: --allgather-gbps = {allgather_gbps} is not allowed; expected a finite speed in GB/s "
                        "> 0 (or leave it out to measure or estimate it).")
    from zinf.config import PRECISIONS
    from zinf.config_sections import RESHARD_AFTER_FORWARD

    if reshard_after_forward not in RESHARD_AFTER_FORWARD:
        raise PlanError(f"zinf plan: --reshard-after-forward {reshard_after_forward!r} is not allowed; expected one "
                        f"of {list(RESHARD_AFTER_FORWARD)} (the engine's overlap.reshard_after_forward).")
    if host_keep not in ("auto", "off"):
        raise PlanError(f"zinf plan: --host-keep {host_keep!r} is not allowed; expected 'auto' or 'off' (the engine's "
                        "overlap.host_keep).")
    precisions = [precision] if isinstance(precision, str) else list(precision)

    for p in precisions:
        if p not in PRECISIONS:
            raise PlanError(f"zinf plan: --precision {p!r} is not allowed; expected one of {sorted(PRECISIONS)}.")
    chosen = [p if isinstance(p, PlanPlacement) else parse_placement(p) for p in placements] if placements else list(ALL_PLACEMENTS)
    paths = list(nvme_paths)
    spec = model_spec(model, params=params, layers=layers, hidden=hidden, vocab=vocab, hf_config=hf_config,
                      hf_kwargs=hf_kwargs, module=module, module_kwargs=module_kwargs, seq_len=seq_len, qlora=qlora)
    seq = min(seq_len or spec.seq_len or 1024, batch_tokens)
    if machine is None:
        h = spec.hidden or 2048
        measured = list(dict.fromkeys(["fp32", *precisions]))  # fp32's rate is the yardstick of a 16-bit one
        machine = measure_machine(paths, measured, world, matmul_shape=(min(batch_tokens, 4096), h, 4 * h),
                                  remeasure=remeasure, allgather_gbps=allgather_gbps)
    else:
        import dataclasses

        from zinf.plan.machine import nvme_free_bytes

        free = nvme_free_bytes(paths)  # the paths must exist, also with a given machine
        machine = dataclasses.replace(machine, nvme_free_bytes={**free, **machine.nvme_free_bytes})
        if allgather_gbps is not None:  # the given speed overrides the machine's figure, as it does a measurement
            machine = dataclasses.replace(machine, allgather_bw=allgather_gbps * 1e9,
                                          allgather_source="given (--allgather-gbps)")
    if ranks_per_node is None:
        ranks_per_node = world if machine.device == "cpu" else min(world, _cuda_count())
    wl = Workload(world=world, batch_tokens=batch_tokens, seq_len=seq, checkpointing=checkpointing,
                  ranks_per_node=ranks_per_node, pinned_pool_bytes=pinned_pool_bytes, sub_group_numel=sub_group_numel,
                  max_cpu_bytes=max_cpu_bytes, reshard_after_forward=reshard_after_forward, host_keep=host_keep)
    notes = []
    if not paths:
        notes.append("no --nvme path: NVMe placements are shown but cannot fit")
    if not spec.hidden or not spec.num_layers:
        notes.append("layers / hidden size unknown: attention and element-wise time left out of the compute estimate")
    estimates = [estimate(spec, machine, wl, pl, prec, paths, calibration) for prec in precisions for pl in chosen]
    slow = slow_16bit(machine, precisions)
    notes += list(slow.values())
    estimates += [estimate(spec, machine, wl, pl, "fp32", paths, calibration, storage=p) for p in slow for pl in chosen]
    frozen = choose_frozen_base(checkpoint, paths, machine.disk_read_bw, machine.nvme_free_bytes) if checkpoint else None
    return Plan(spec, machine, wl, paths, estimates, recommend(estimates), notes, frozen)


def recommend(estimates: Sequence[Estimate]) -> Estimate | None:
    """The fastest placement that fits; among those within TIE_TOLERANCE of it, the fewest offloads, then fp32
    moments (exact against torch's Adam) over compact ones."""
    fitting = [e for e in estimates if e.fits and not math.isnan(e.seconds["step"])]
    if not fitting:
        return None
    best = min(e.seconds["step"] for e in fitting)
    close = [e for e in fitting if e.seconds["step"] <= best * (1 + TIE_TOLERANCE)]
    return min(close, key=lambda e: (e.placement.num_offloads, e.placement.moments != "fp32", e.seconds["step"]))


def _cuda_count() -> int:  # pragma: no cover - CUDA only
    import torch

    return max(1, torch.cuda.device_count())
