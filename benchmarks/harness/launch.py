"""Run one system on one model in fresh processes under the watchdog and turn what it measured into a row.

A row holds the run's identity (model, system, ranks, global batch), its status (``ok``, ``skipped``,
``failed`` or ``killed`` with the error), the step time (median of the steps after the warm-up), tokens/s,
achieved FLOP/s and their share of the machine's measured matmul peak, peak resident bytes per rank (the
watchdog's samples of each rank's process tree), the device's peak allocated bytes (CUDA), the NVMe
directory's peak bytes, and for zinf the median of each StepReport category over the same steps."""

from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import sys

from harness import models, systems
from harness.watchdog import GIB, Limits, free_port, run_ranks

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
DS_VENV_HINT = ("python -m venv --system-site-packages /work/dsvenv && /work/dsvenv/bin/pip install deepspeed "
                "(NVMe offload also needs libaio-dev)")
# StepReport categories kept per row (median over the measured steps), as "zinf/<name>" in report.metrics()
BREAKDOWN = ("forward", "backward", "compute", "all_gather", "reduce_scatter", "rounds", "broadcast_buffers",
             "optimizer", "optimizer_wait", "adam", "adam_early", "nvme_read", "nvme_write", "background_nvme_read", "background_nvme_write",
             "io_hidden_share", "nvme_read_bytes", "nvme_written_bytes")


def run_system(system: str, model: str, *, ranks: int, global_batch: int, steps: int, warmup: int, threads: int,
               limits: Limits, work_dir: str, ds_python: str, device: str, peak_flops: float,
               tag: str = "", precision: str = "fp32", backend: str | None = None, build_on_cpu: bool = False,
               zinf_pythons: dict[str, str] | None = None) -> dict:
    """``backend``: the process group's (default NCCL on CUDA, gloo on the CPU); ``build_on_cpu``: see
    systems.Context. ``system`` may name another build of zinf (``zinf-mem@base``): run by the interpreter
    ``zinf_pythons`` gives for it; ``SYSTEM+compile`` compiles each block with ``torch.compile`` (inductor)."""
    spec = models.parse(model)
    system, _, build = system.partition("@")
    system, _, compiled = system.partition("+")
    info = systems.SYSTEMS[system]
    counts = models.counts(spec)
    row: dict = {"model": spec.name, "family": spec.family, "n_layer": spec.n_layer, "n_embd": spec.n_embd,
                 "numel": counts.numel,
                 "system": system + (f"+{compiled}" if compiled else "") + (f"@{build}" if build else ""),
                 "label": info.label + (", compiled" if compiled else "") + (f" ({build})" if build else ""),
                 "ranks": ranks,
                 "global_batch": global_batch, "block": spec.block, "steps": steps, "warmup": warmup,
                 "flops_per_token": counts.flops_per_token, "device": device, "tag": tag, "precision": precision}
    if global_batch % ranks:
        raise SystemExit(f"global batch {global_batch} does not split over {ranks} ranks: pass a --global-batch "
                         f"that {ranks} divides")
    python = (zinf_pythons or {})[build] if build else sys.executable
    if info.kind == "deepspeed":
        if not os.path.exists(ds_python):
            row.update(status="skipped", error=f"no DeepSpeed interpreter at {ds_python} (make one: {DS_VENV_HINT})")
            return row
        python = ds_python
    name = f"{system}{'-compiled' if compiled else ''}{'-' + build if build else ''}-{spec.name.replace(':', '_')}-r{ranks}{tag}"
    nvme_dir = os.path.join(work_dir, "nvme", name)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir, exist_ok=True)
    os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
    child_spec = {"system": system, "model": model, "global_batch": global_batch, "steps": steps,
                  "nvme_dir": nvme_dir, "device": device, "precision": precision, "backend": backend,
                  "build_on_cpu": build_on_cpu, "compile": bool(compiled)}
    port = free_port()
    envs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks),
                   LOCAL_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(max(1, threads // ranks)))
        if info.kind == "deepspeed" and device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        envs.append(env)
    out = run_ranks([python, CHILD, json.dumps(child_spec)], envs, limits=limits,
                    log_path=os.path.join(work_dir, "logs", name + ".log"), disk_dir=nvme_dir,
                    progress_every_s=60.0)
    shutil.rmtree(nvme_dir, ignore_errors=True)
    if info.kind == "deepspeed":
        drop_deepspeed_shm(port)
    row.update(wall_s=out.wall_s, peak_rss_per_rank_gib=max(out.peak_rss_per_rank_bytes) / GIB,
               peak_rss_ranks_gib=[b / GIB for b in out.peak_rss_per_rank_bytes],
               peak_rss_total_gib=out.peak_rss_bytes / GIB)
    res = out.result or {}
    row["disk_peak_gib"] = max(out.peak_disk_bytes, res.get("disk_bytes_end", 0)) / GIB
    # a rank that dies after training and measuring (while closing or exiting) leaves valid measurements: the row
    # counts as run, and says how the process ended
    after = ("close", "destroy_process_group", "exit")
    late = out.result is not None and out.killed is None and all(
        rc == 0 or ph in after for rc, ph in zip(out.returncodes, out.phases))
    if late and not out.ok:
        row["exit_error"] = f"rank(s) {[r for r, rc in enumerate(out.returncodes) if rc != 0]} exited with " \
                            f"{[rc for rc in out.returncodes if rc != 0]} during {out.phases}: {out.error_line()}"
    elif not out.ok:
        row.update(status="killed" if out.killed else "failed", error=out.killed or out.error_line(), where=out.phase,
                   detail=out.status())
        return row
    measured = res["times"][warmup:] or res["times"][-1:]
    step_s = statistics.median(measured)
    tokens_per_s = global_batch * spec.block / step_s
    row.update(status="ok", error="", build_s=res["build_s"], times=res["times"], finish_s=res.get("finish_s"),
               losses=res["losses"],
               step_s=step_s, tokens_per_s=tokens_per_s, flops_per_s=tokens_per_s * counts.flops_per_token,
               device_peak_gib=res["device_peak_bytes"] / GIB)
    peak = peak_flops * (ranks if device == "cuda" else 1)  # one GPU per rank; on CPU the ranks share the cores
    row["peak_share"] = row["flops_per_s"] / peak if peak else None
    if "ds_version" in res:
        row["ds_version"] = res["ds_version"]
    reports = [b for b in res["breakdowns"][warmup:] if b] or [b for b in res["breakdowns"] if b]
    for key in BREAKDOWN:
        values = [b[f"zinf/{key}"] for b in reports if f"zinf/{key}" in b]
        if values:
            row[f"zinf_{key}"] = statistics.median(values)
    return row


def drop_deepspeed_shm(port: int) -> None:
    """Unlink the shared-memory files DeepSpeed's CPU all-reduce (``deepspeed_shm_comm``) made for the run on
    ``port``: DeepSpeed 0.19.8 creates one per rank (66 MiB each, in /dev/shm: memory, not disk) and never
    unlinks it, so without this every DeepSpeed run would leave ~130 MiB of RAM taken for the runs after it."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass
