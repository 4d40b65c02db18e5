"""One rank of one benchmark run: ``python benchmarks/harness/child.py '<json spec>'`` (started by launch.py).

Sets up the system, trains ``steps`` steps on its rows of the global batch and prints PHASE lines for the
watchdog and, on rank 0, one RESULT line: construction seconds, each step's seconds and loss (the mean over the
ranks: the global batch's, as one process computes it), zinf's per-step breakdown, the device's peak allocated bytes (max over ranks, CUDA only) and the bytes in the run's NVMe
directory (all ranks' files) at the end of training (before the engine removes its files)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import models, systems  # noqa: E402
from harness.watchdog import dir_bytes, phase  # noqa: E402


def main(spec: dict) -> None:
    name = spec["system"]
    kind = systems.SYSTEMS[name].kind
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and spec["device"] == "cuda"
    # ranks beyond the GPUs share them (gloo with CUDA tensors runs several ranks on one GPU)
    local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count() if cuda else 1)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = spec.get("backend") or ("nccl" if cuda else "gloo")
    if kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif kind != "plain":
        dist.init_process_group(backend)
    model_spec = models.parse(spec["model"])
    ctx = systems.Context(rank=rank, world=world, device=device, global_batch=spec["global_batch"],
                          nvme_dir=spec["nvme_dir"], precision=spec.get("precision", "fp32"),
                          build_on_cpu=spec.get("build_on_cpu", False))
    phase("construction")
    t0 = time.perf_counter()
    run = systems.setup(name, model_spec, ctx)
    if spec.get("compile"):  # each block compiled in place, after the system wrapped or sharded it (torchtitan's way)
        for block in models.blocks(run.model, model_spec):
            block.compile()
    build_s = time.perf_counter() - t0
    times, losses, breakdowns = [], [], []
    for i in range(spec["steps"]):
        phase(f"step {i}")
        idx, tgt = models.batch(model_spec, spec["global_batch"], i, rank, world)
        idx, tgt = idx.to(device), tgt.to(device)
        t = time.perf_counter()
        loss = run.train_step(idx, tgt)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        breakdowns.append(run.breakdown())
    phase("finish")
    t = time.perf_counter()
    # zinf: the last background optimizer step, timed apart: in steady state each step waits for the one before
    # it, so adding this to the last step would count two sweeps in it
    run.finish()
    finish_s = time.perf_counter() - t
    disk = dir_bytes(spec["nvme_dir"]) if os.path.isdir(spec["nvme_dir"]) else 0
    device_peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    if world > 1 and dist.is_initialized():
        both = torch.tensor([device_peak, disk], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # every rank sees the run's whole NVMe directory
        device_peak, disk = int(both[0]), int(both[1])
        mean = torch.tensor(losses, dtype=torch.float64, device=device)  # once, after the timed steps
        dist.all_reduce(mean)
        losses = (mean / world).tolist()
    phase("close")
    run.close()
    if rank == 0:
        out = {"build_s": build_s, "times": times, "finish_s": finish_s, "losses": losses, "breakdowns": breakdowns,
               "device_peak_bytes": device_peak, "disk_bytes_end": disk,
               "rank0_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if kind == "deepspeed":
            import deepspeed

            out["ds_version"] = deepspeed.__version__
        print("RESULT " + json.dumps(out), flush=True)
    if dist.is_initialized():
        phase("destroy_process_group")
        dist.destroy_process_group()
    phase("exit")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
