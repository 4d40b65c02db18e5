"""Does ``zinf plan`` predict real runs? Planner vs a short training run, for several sizes and placements.

    python benchmarks/plan_check.py [--nvme /tmp/zinf-plan-check] [--steps 10] [--only NAME ...] [--world2]

For each configuration (a GPT from examples/gpt.py at a size, a placement, a precision), the planner is run on
the model built on the meta device (this machine measured as ``zinf plan`` does), then the same model trains
for ``--steps`` steps on one rank (``--world2``: also two gloo ranks on this machine). Measured: the median step
time after two warm-up steps (forward + backward + step, so a background optimizer step shows up in the next
forward's waits) and the bytes per tier from ``engine.resident_bytes()``, the largest of the values after a
backward (gradient shards on NVMe are there) and after a step. Model states only: activations and gathered
parameters are not in ``resident_bytes`` (the gathered peak is compared on its own line when it is predicted).
Without CUDA the device tier is host memory, so device and CPU are compared together as "host".

Bounds: bytes per tier within 10%, step time within 30% (ratio measured / predicted in [0.77, 1.30]).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
import zinf.plan  # noqa: E402
from zinf.plan.machine import measure_flops, measure_host_bw  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402


@dataclass
class Case:
    name: str
    layers: int
    embd: int
    vocab: int
    batch: int
    placement: str  # params/optimizer[/grads]
    precision: str = "fp32"
    world: int = 1
    pool_bytes: int | None = None  # offload.pinned_pool_bytes (None: what the planner recommends)


CASES = [
    Case("S dev/dev", 4, 256, 4096, 4, "device/device"),
    Case("M dev/dev", 6, 384, 8192, 4, "device/device"),
    Case("M dev/cpu", 6, 384, 8192, 4, "device/cpu"),
    Case("M nvme/nvme", 6, 384, 8192, 4, "nvme/nvme"),
    Case("M nvme/nvme pool 256M", 6, 384, 8192, 4, "nvme/nvme", pool_bytes=256 << 20),
    Case("L dev/cpu bf16", 8, 512, 8192, 4, "device/cpu", "bf16"),
    Case("L nvme/nvme/cpu", 8, 512, 8192, 4, "nvme/nvme/cpu"),
]
WORLD2 = [Case("S dev/dev w2", 4, 256, 4096, 4, "device/device", world=2)]


def gpt_config(c: Case) -> GPTConfig:
    return GPTConfig(vocab=c.vocab, block=128, n_embd=c.embd, n_head=8, n_layer=c.layers)


def predict(c: Case, nvme: str, machine: zinf.plan.Machine | None = None) -> zinf.plan.Plan:
    with torch.device("meta"):
        model = GPT(gpt_config(c))
    return zinf.plan.plan(model, world=c.world, precision=c.precision, nvme_paths=[nvme], seq_len=128,
                          batch_tokens=c.batch * 128, placements=[c.placement], machine=machine,
                          pinned_pool_bytes=c.pool_bytes)


def _merge_max(a: dict, b: dict) -> dict:
    out = {t: dict(k) for t, k in a.items()}
    for t, kinds in b.items():
        for k, v in kinds.items():
            out.setdefault(t, {})[k] = max(out.get(t, {}).get(k, 0), v)
    return out


def train(c: Case, est: zinf.plan.Estimate, plan: zinf.plan.Plan, steps: int, rank: int = 0) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict(plan.config(est))
    with zinf.Init(config):
        model = GPT(gpt_config(c))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    times, peak, reports, flops, host_bw = [], {}, [], [], []
    shape = (c.batch * 128, c.embd, 4 * c.embd)
    for step in range(steps):
        idx, tgt = synthetic_batch(gpt_config(c), c.batch, step, rank)
        t = time.perf_counter()
        loss = engine(idx, tgt)
        engine.backward(loss)
        t_bwd = time.perf_counter()
        peak = _merge_max(peak, engine.resident_bytes())
        # probes of the machine's speed now, between backward and step: no background optimizer step is running
        # (the backward waited for it), and their time is left out of the step's
        flops.append(measure_flops(torch.device("cpu"), c.precision, shape, windows=1, budget_seconds=0.15))
        host_bw.append(measure_host_bw(64 << 20, reps=3))
        t_probe = time.perf_counter()
        engine.step()
        times.append(t_bwd - t + time.perf_counter() - t_probe)
        peak = _merge_max(peak, engine.resident_bytes())
        reports.append(engine.report())
    keep = reports[2:]
    out = {"step": statistics.median(times[2:]), "bytes": peak,
           "nvme_read": statistics.median(r.counts.get("nvme_read_bytes", 0) for r in keep),
           "nvme_write": statistics.median(r.counts.get("nvme_written_bytes", 0) for r in keep),
           "gathered": max(r.peak_gathered_bytes for r in reports),
           "compute": statistics.median(r.seconds.get("compute", 0.0) for r in keep),
           "optimizer": statistics.median(r.seconds.get("optimizer", 0.0) for r in keep),
           "comm": statistics.median(r.seconds.get("all_gather", 0.0) + r.seconds.get("reduce_scatter", 0.0) for r in keep),
           "loss": float(loss.detach()), "flops": statistics.median(flops[2:]), "host_bw": statistics.median(host_bw[2:]),
           "threads": torch.get_num_threads()}
    engine.close()
    return out


def _world2_worker(rank: int, c: Case, est: zinf.plan.Estimate, plan: zinf.plan.Plan, steps: int, port: int,
                   queue) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = train(c, est, plan, steps, rank)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def train_world2(c: Case, est: zinf.plan.Estimate, plan: zinf.plan.Plan, steps: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_world2_worker, args=(c, est, plan, steps, port, queue), nprocs=2, join=True, start_method="spawn")
    return queue.get(timeout=10)


def _host(bytes_by_tier: dict, tiers: tuple[str, ...], states_only: bool = True) -> int:
    kinds = ("param_shards", "master", "grad_shards", "optimizer_state", "pinned_pool")
    return sum(v for t in tiers for k, v in bytes_by_tier.get(t, {}).items() if not states_only or k in kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme", default="/tmp/zinf-plan-check")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", nargs="*", help="names of the cases to run (default: all)")
    ap.add_argument("--world2", action="store_true", help="also a two-rank gloo run on this machine")
    ap.add_argument("--threads", type=int, default=0, help="torch and CPU-Adam threads (default: torch's default)")
    args = ap.parse_args()
    os.makedirs(args.nvme, exist_ok=True)
    cases = [c for c in CASES + (WORLD2 if args.world2 else []) if not args.only or c.name in args.only]
    cuda = torch.cuda.is_available()
    tiers = (("device", "cpu", "nvme") if cuda else ("host", "nvme"))
    rows = []
    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
        zinf.native.set_num_threads(args.threads)
    for c in cases:
        plan = predict(c, args.nvme)
        est = plan.estimates[0]
        real = train_world2(c, est, plan, args.steps) if c.world > 1 else train(c, est, plan, args.steps)
        # a shared machine's speed moves from minute to minute: the prediction compared uses the compute and host
        # memory figures probed between the steps of the run (the disks' and the rest as measured before it)
        # (with two ranks every rank probes at once: its figures are one rank's share, so the host bandwidth, which
        # the planner divides among the ranks, is scaled back up; the compute probe ran on one rank's threads)
        bw = real["host_bw"] * c.world
        during = dataclasses.replace(plan.machine, flops={c.precision: real["flops"]}, host_bw=bw, device_bw=bw,
                                     threads=real["threads"],
                                     allgather_bw=plan.machine.allgather_bw and bw * zinf.plan.machine.GLOO_FRACTION_OF_HOST_BW)
        real["pred_before"] = est.seconds["step"]
        est = predict(c, args.nvme, during).estimates[0]
        rows.append((c, plan, est, real))
        print(f"[{time.perf_counter() - start:6.1f} s] {c.name}: predicted {real['pred_before']:.3f} s with the machine "
              f"measured before the run ({plan.machine.flops[c.precision] / 1e9:.0f} GFLOP/s, {plan.machine.host_bw / 1e9:.1f} "
              f"GB/s), {est.seconds['step']:.3f} s with it probed during the run ({real['flops'] / 1e9:.0f} GFLOP/s, "
              f"{real['host_bw'] / 1e9:.1f} GB/s); measured {real['step']:.3f} s, loss {real['loss']:.4f}", flush=True)
    m = rows[0][1].machine
    print()
    print(f"machine: {m.device_name}; host RAM available {m.host_bytes / 2**30:.1f} GiB; measured: "
          + ", ".join(f"{k} matmul {v / 1e9:.0f} GFLOP/s" for k, v in m.flops.items())
          + f", host copy {m.host_bw / 1e9:.1f} GB/s"
          + "".join(f", disk {p} read {m.disk_read_bw[p] / 1e9:.2f} / write {m.disk_write_bw[p] / 1e9:.2f} GB/s"
                    for p in m.disk_read_bw))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps, median after 2 warm-up")
    print()
    head = "| case | params | placement | tokens/step |" + "".join(
        f" {t} MiB pred / meas (ratio) |" for t in tiers) + " step s pred before / pred during / meas (ratio to during) | NVMe GB/step pred / meas |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    worst_bytes, worst_time = 0.0, 0.0
    for c, plan, est, real in rows:
        cells = []
        for t in tiers:
            if t == "host":
                pred = est.tier_bytes("device", True) + est.tier_bytes("cpu", True)
                meas = _host(real["bytes"], ("cpu",))
            else:
                pred, meas = est.tier_bytes(t, True), _host(real["bytes"], (t,))
            ratio = meas / pred if pred else (1.0 if not meas else float("inf"))
            if pred or meas:
                worst_bytes = max(worst_bytes, abs(ratio - 1))
            cells.append(f" {pred / 2**20:.1f} / {meas / 2**20:.1f} ({ratio:.2f}) |" if pred or meas else " 0 / 0 |")
        r = real["step"] / est.seconds["step"]
        worst_time = max(worst_time, max(r, 1 / r) - 1)
        io_pred = (est.io_bytes["nvme_read"] + est.io_bytes["nvme_write"]) / 1e9
        io_meas = (real["nvme_read"] + real["nvme_write"]) / 1e9
        print(f"| {c.name} | {plan.model.numel / 1e6:.1f}M | {c.placement} {c.precision}"
              f"{' w' + str(c.world) if c.world > 1 else ''} | {c.batch * 128} |" + "".join(cells)
              + f" {real['pred_before']:.3f} / {est.seconds['step']:.3f} / {real['step']:.3f} ({r:.2f}) |"
              f" {io_pred:.2f} / {io_meas:.2f} |")
    print()
    print("predicted parts (s): " + "; ".join(
        f"{c.name}: compute {e.seconds['compute']:.3f}, optimizer {e.seconds['optimizer']:.3f}"
        + (f", nvme {e.seconds['nvme']:.3f}" if "nvme" in e.seconds else "")
        + (f", all-gather + reduce-scatter {e.seconds['allgather']:.3f}" if "allgather" in e.seconds else "")
        + f" | measured compute {r['compute']:.3f}, step() {r['optimizer']:.3f}"
        + (f", in gathers and reduce-scatters {r['comm']:.3f}" if c.world > 1 else "") for c, _, e, r in rows))
    print("gathered peak MiB pred / meas: " + "; ".join(
        f"{c.name}: {e.bytes['device'].get('gathered_peak', 0) / 2**20:.1f} / {r['gathered'] / 2**20:.1f}"
        for c, _, e, r in rows))
    print(f"\nworst bytes error {100 * worst_bytes:.1f}% (bound 10%), worst step-time error {100 * worst_time:.1f}% "
          f"(bound 30%); total {time.perf_counter() - start:.0f} s")
    shutil.rmtree(args.nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
