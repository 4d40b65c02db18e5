"""A short torch.profiler trace of a few training steps of one system, summarised:
``python benchmarks/harness/profile_steps.py '<json spec>'`` prints one ``RESULT <json>`` line.

Spec: ``system`` (harness/systems.py), ``model``, ``global_batch``, ``precision``, ``device``, ``warmup`` steps
left out, ``steps`` profiled. One process, no process group (one rank: an all-gather is a copy).

The summary says where the host's time goes and whether the step is launch-bound:
- ``step_ms``: each profiled step's wall time (host clock, the device synchronised after the step);
- ``device_busy_ms``: the device time of every kernel and copy in a step (their sum: kernels on different streams
  that overlap count twice, so it can pass the wall time);
- ``device_busy_share``: device_busy_ms / step_ms. Under ``LAUNCH_BOUND_SHARE`` the device sat idle for much of the
  step waiting for the host to queue work (launch- or host-bound); near 1 the host ran ahead (device-bound);
- ``launches``: kernel launches per step, and the host's self time per launch;
- ``top_host_ops``: the operators with the most host self time per step; ``zinf_regions``: zinf's profiler labels
  (``zinf::all_gather(blocks.3)`` and the like) summed by verb, with their host time per step (inclusive).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from harness import models, systems  # noqa: E402

LAUNCH_BOUND_SHARE = 0.7
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
TOP = 12


def _us(event: object, *names: str) -> float:
    """The first of these timing attributes the event has (torch renamed cuda_* to device_*), in microseconds."""
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def summarise(prof: torch.profiler.profile, step_s: list[float], cuda: bool) -> dict:
    steps = len(step_s)
    averages = prof.key_averages()
    step_ms = [s * 1e3 for s in step_s]
    wall_ms = sum(step_ms) / steps
    out: dict = {"steps": steps, "step_ms": step_ms, "step_ms_mean": wall_ms}
    host = []
    zinf_regions: dict[str, dict[str, float]] = {}
    device_us = 0.0
    launches, launch_us = 0, 0.0
    for e in averages:
        device_us += _us(e, "self_device_time_total", "self_cuda_time_total")
        if e.key.startswith("ProfilerStep"):
            continue
        self_us = _us(e, "self_cpu_time_total")
        if e.key in LAUNCH_NAMES:
            launches += e.count
            launch_us += self_us
        if e.key.startswith("zinf::"):
            verb = e.key.split("(", 1)[0]
            region = zinf_regions.setdefault(verb, {"count_per_step": 0.0, "host_ms_per_step": 0.0})
            region["count_per_step"] += e.count / steps
            region["host_ms_per_step"] += _us(e, "cpu_time_total") / 1e3 / steps
        elif self_us > 0:
            host.append({"op": e.key, "count_per_step": e.count / steps, "self_host_ms_per_step": self_us / 1e3 / steps})
    host.sort(key=lambda h: -h["self_host_ms_per_step"])
    out["top_host_ops"] = host[:TOP]
    out["host_self_ms_per_step"] = sum(h["self_host_ms_per_step"] for h in host)
    out["zinf_regions"] = dict(sorted(zinf_regions.items(), key=lambda kv: -kv[1]["host_ms_per_step"]))
    if cuda:
        busy_ms = device_us / 1e3 / steps
        share = busy_ms / wall_ms if wall_ms > 0 else None
        out.update(device_busy_ms=busy_ms, device_busy_share=share, launches_per_step=launches / steps,
                   host_us_per_launch=launch_us / launches if launches else None,
                   launch_bound=share is not None and share < LAUNCH_BOUND_SHARE)
    else:
        out.update(device_busy_ms=None, device_busy_share=None, launches_per_step=None, host_us_per_launch=None,
                   launch_bound=None)
    return out


def main(spec: dict) -> None:
    cuda = spec["device"] == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model_spec = models.parse(spec["model"])
    ctx = systems.Context(rank=0, world=1, device=device, global_batch=spec["global_batch"],
                          nvme_dir=spec.get("nvme_dir", ""), precision=spec["precision"])
    run = systems.setup(spec["system"], model_spec, ctx)

    def step(i: int) -> float:
        idx, tgt = models.batch(model_spec, spec["global_batch"], i, 0, 1)
        t = time.perf_counter()
        run.train_step(idx.to(device), tgt.to(device))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for i in range(spec["warmup"]):
        step(i)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step_s = [step(spec["warmup"] + i) for i in range(spec["steps"])]
    run.finish()
    result = summarise(prof, step_s, cuda)
    result.update(system=spec["system"], model=model_spec.name, precision=spec["precision"], device=str(device),
                  global_batch=spec["global_batch"])
    run.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
