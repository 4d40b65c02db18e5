"""How large a GPT do the baselines train on this machine? Plain PyTorch, FSDP2 and DeepSpeed ZeRO-3 NVMe.

    # one run at the target size (n_embd 2560, 40 layers, vocab 32768: about 3.23B parameters)
    flock /tmp/zinf-machine.lock python benchmarks/bench_scale_baselines.py --baseline plain --layers 40
    # the largest n_layer (n_embd 2560) that trains, bisected between two layer counts
    flock /tmp/zinf-machine.lock python benchmarks/bench_scale_baselines.py --baseline plain --bisect 8 24
    # baselines: plain | fsdp2 (--ranks 1 or 2, --cpu-offload for CPUOffloadPolicy) | deepspeed (ZeRO-3,
    # offload_param and offload_optimizer on NVMe under --nvme, run with --ds-python and DS_ACCELERATOR=cpu)

Each run trains the GPT of examples/gpt.py (batch 1 per rank, block 64, n_head = n_embd / 128, AdamW
lr=1e-4, fp32) for --steps steps in fresh subprocesses and records the construction time (model built
and, for FSDP2/DeepSpeed, sharded, optimizer made), each step's time and the peak RSS summed over all
its processes. A watchdog samples that sum every 0.2 s and kills the whole run (SIGKILL to its process
groups) when it passes --limit-gib (default 21 GiB), when the machine's MemAvailable drops under
--min-avail-gib, when the NVMe directory's disk has under 3 GiB free, or when --cap-min minutes pass;
the row then says where it was killed ("construction" or "step N"), so the kernel's OOM killer never
fires. FSDP2 ranks run as processes of this script with a gloo process group (torch's CPU backend); every
rank builds the full model from seed 0 and fully_shard shards each block and then the root. DeepSpeed's
model is built under deepspeed.zero.Init (parameters go to NVMe as they are made). Rows are appended
as JSON lines to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
sys.path.insert(0, HERE)
from harness.watchdog import GIB, Limits, free_port, phase, run_ranks  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One rank of one run: build, train --steps steps, print PHASE lines and (rank 0) a RESULT line."""
    import torch

    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, GPTConfig, synthetic_batch

    rank = int(os.environ.get("RANK", "0"))
    cfg = GPTConfig(vocab=args.vocab, block=args.block, n_embd=args.embd, n_head=max(1, args.embd // 128),
                    n_layer=args.layers)
    phase("construction")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    extra: dict = {}
    if args.baseline == "plain":
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fwd, bwd = model, (lambda loss: loss.backward())

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif args.baseline == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        kw = {"mesh": mesh}
        if args.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fwd, bwd = model, (lambda loss: loss.backward())

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        nvme = {"device": "nvme", "nvme_path": args.nvme, "pin_memory": False}
        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "sub_group_size": args.ds_sub_group,
                                    "offload_param": dict(nvme), "offload_optimizer": dict(nvme)},
              "steps_per_print": 1 << 30}
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = GPT(cfg)
        phase("construction (deepspeed.initialize)")
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        fwd, bwd, step = engine, engine.backward, engine.step
        extra["ds_version"] = deepspeed.__version__
    build = time.perf_counter() - t0
    # global sizes: DeepSpeed keeps them in ds_numel, FSDP2's DTensor parameters report the global shape
    numel = sum(getattr(p, "ds_numel", p.shape.numel()) for p in dict.fromkeys(model.parameters()))
    print(f"BUILT {build:.1f}s", flush=True)
    times, losses = [], []
    for i in range(args.steps):
        phase(f"step {i}")
        idx, tgt = synthetic_batch(cfg, 1, i, rank)
        t = time.perf_counter()
        loss = fwd(idx, tgt)
        bwd(loss)
        step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        print(f"STEP {i} {times[-1]:.2f}s loss {losses[-1]:.4f}", flush=True)
    phase("done")
    if rank == 0:
        out = {"numel": numel, "build": build, "times": times, "losses": losses,
               "rank0_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **extra}
        print("RESULT " + json.dumps(out), flush=True)
    if args.baseline == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()


def numel_of(layers: int, embd: int, vocab: int, block: int) -> int:
    per_layer = 12 * embd * embd + 13 * embd
    return vocab * embd + block * embd + layers * per_layer + 2 * embd


def run_once(args: argparse.Namespace, layers: int) -> dict:
    """Launch one run (all its ranks) under the watchdog; return its row."""
    ranks = args.ranks if args.baseline == "fsdp2" else 1
    nvme = os.path.join(args.nvme, f"{args.baseline}-L{layers}")
    if args.baseline == "deepspeed":
        shutil.rmtree(nvme, ignore_errors=True)
        os.makedirs(nvme, exist_ok=True)
    python = args.ds_python if args.baseline == "deepspeed" else sys.executable
    port = free_port()
    cmd = [python, os.path.abspath(__file__), "--child", "--baseline", args.baseline, "--layers", str(layers),
           "--embd", str(args.embd), "--vocab", str(args.vocab), "--block", str(args.block),
           "--steps", str(args.steps), "--nvme", nvme, "--ds-sub-group", str(args.ds_sub_group)]
    if args.cpu_offload:
        cmd.append("--cpu-offload")
    row = {"baseline": args.baseline + (f" x{ranks}" if args.baseline == "fsdp2" else "")
           + (" +CPUOffloadPolicy" if args.cpu_offload else ""),
           "layers": layers, "embd": args.embd, "vocab": args.vocab,
           "numel": numel_of(layers, args.embd, args.vocab, args.block)}
    envs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(max(1, args.threads // ranks)))
        if args.baseline == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
        envs.append(env)
    limits = Limits(rss_gib=args.limit_gib, min_avail_gib=args.min_avail_gib, cap_s=args.cap_min * 60)
    out = run_ranks(cmd, envs, limits=limits, log_path=os.path.join(args.logdir, f"{args.baseline}-L{layers}.log"),
                    disk_dir=nvme if args.baseline == "deepspeed" else None)
    row.update(out.result or {})
    row["wall"] = out.wall_s
    row["peak_rss_gib"] = out.peak_rss_bytes / GIB
    if args.baseline == "deepspeed":
        row["nvme_peak_gb"] = out.peak_disk_bytes / 1e9
        shutil.rmtree(nvme, ignore_errors=True)
    row["status"] = out.status()
    if out.ok:
        row["step"] = statistics.median(row["times"])
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(fmt(row), flush=True)
    return row


def fmt(row: dict) -> str:
    step = f"{row['step']:.2f}" if "step" in row else "-"
    build = f"{row['build']:.1f}" if "build" in row else "-"
    times = " ".join(f"{t:.1f}" for t in row.get("times", []))
    disk = f" nvme {row['nvme_peak_gb']:.1f} GB" if "nvme_peak_gb" in row else ""
    return (f"{row['baseline']:<26} L={row['layers']:<3} {row['numel'] / 1e9:6.3f}B  peak RSS {row['peak_rss_gib']:6.2f} GiB  "
            f"build {build:>6}s  step {step:>7}s [{times}]{disk}  wall {row['wall']:.0f}s  {row['status']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", choices=("plain", "fsdp2", "deepspeed"), required=True)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--embd", type=int, default=2560)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1, help="FSDP2 processes")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 with CPUOffloadPolicy")
    p.add_argument("--bisect", type=int, nargs=2, metavar=("LO", "HI"),
                   help="largest n_layer in [LO, HI] that trains (LO assumed to, HI tried first if untested)")
    p.add_argument("--limit-gib", type=float, default=21.0)
    p.add_argument("--min-avail-gib", type=float, default=1.0)
    p.add_argument("--cap-min", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--nvme", default="/work/nvme-baselines")
    p.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    p.add_argument("--ds-sub-group", type=int, default=100_000_000, help="DeepSpeed zero_optimization.sub_group_size")
    p.add_argument("--results", default="/work/nvme-baselines/scale_results.jsonl")
    p.add_argument("--logdir", default="/work/nvme-baselines/logs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    os.makedirs(args.nvme, exist_ok=True)
    os.makedirs(args.logdir, exist_ok=True)
    print(f"{args.baseline}: n_embd {args.embd}, vocab {args.vocab}, block {args.block}, batch 1/rank, {args.steps} steps, "
          f"watchdog {args.limit_gib} GiB, cap {args.cap_min} min", flush=True)
    if not args.bisect:
        run_once(args, args.layers)
        return
    lo, hi = args.bisect
    rows = [run_once(args, hi)]
    if rows[-1]["status"] == "ok":
        print(f"largest tried trains: L={hi}")
        return
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rows.append(run_once(args, mid))
        if rows[-1]["status"] == "ok":
            lo = mid
        else:
            hi = mid
    best = [r for r in rows if r["layers"] == lo and r["status"] == "ok"]
    print(f"\nlargest that trains: L={lo} ({numel_of(lo, args.embd, args.vocab, args.block) / 1e9:.3f}B parameters)"
          + ("" if best else " (assumed, not run here)") + f"; L={hi} does not")
    print("\nsummary:")
    for r in sorted(rows, key=lambda r: r["layers"]):
        print(fmt(r))


if __name__ == "__main__":
    main()
