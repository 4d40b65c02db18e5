"""zinf against DeepSpeed ZeRO-3 on the same GPT, one rank, in memory and with NVMe offload.

    flock /tmp/zinf-machine.lock python benchmarks/bench_vs_deepspeed.py \
        [--layers 9 --embd 256 --vocab 8192 --batch 4 --steps 8 --nvme /work/nvme-baselines \
         --ds-python /work/dsvenv/bin/python]

Four variants, each in its own subprocess, back to back: zinf in memory, zinf with parameters and
optimizer states on NVMe, DeepSpeed ZeRO-3 in memory, DeepSpeed ZeRO-3 with offload_param and
offload_optimizer on NVMe (same directory). DeepSpeed is an optional benchmark dependency and never a
project one: it lives in its own virtual environment (``--ds-python``; made with
``python -m venv --system-site-packages /work/dsvenv && /work/dsvenv/bin/pip install deepspeed``;
NVMe offload JIT-builds DeepSpeed's async_io op, which needs libaio-dev) and runs on this CPU-only
machine with DS_ACCELERATOR=cpu and a single-process gloo "launch".

Every variant uses seed 0 for the model, the same synthetic batches and AdamW lr=1e-4 (torch AdamW
for zinf; DeepSpeed's own AdamW from its config, which is DeepSpeedCPUAdam when the optimizer is
offloaded: DeepSpeed refuses a client optimizer with ZeRO-Offload). DeepSpeed's model is built whole
and partitioned by deepspeed.initialize unless --ds-zero-init, so its initial weights equal zinf's and
plain PyTorch's and the first losses can be compared. The step time is the median of
the steps after the warm-up ones; peak RSS is the subprocess's ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "examples")
VARIANTS = ("zinf-mem", "zinf-nvme", "ds-mem", "ds-nvme")
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args: argparse.Namespace) -> dict:
    """Run one variant in this process and return its measurements."""
    import torch

    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=args.vocab, block=args.block, n_embd=args.embd, n_head=args.heads, n_layer=args.layers)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.variant.startswith("zinf"):
        import zinf

        zcfg = {}
        if args.variant == "zinf-nvme":
            zcfg = {"offload": {"params": "nvme", "optimizer": "nvme", "grads": "nvme", "nvme_paths": [args.nvme],
                                "pinned_pool_bytes": 512 << 20, "sub_group_numel": 8 << 20}}
        config = zinf.ZeroConfig.from_dict(zcfg)
        with zinf.Init(config):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = zinf.initialize(model, opt, config)
        opt_name = type(opt).__name__
        backward, step, close = engine.backward, engine.step, engine.close
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        zero: dict = {"stage": 3}
        if args.variant == "ds-nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme, "pin_memory": False}
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme, "pin_memory": False}
        ds = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": ADAMW},
              "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
        if args.ds_zero_init:
            with deepspeed.zero.Init(config_dict_or_path=ds):
                model = GPT(cfg)
        else:  # built whole, partitioned by deepspeed.initialize: the same initial weights as plain PyTorch
            model = GPT(cfg)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        opt_name = f"{type(opt).__name__}/{type(getattr(opt, 'optimizer', opt)).__name__}"
        backward, step, close = engine.backward, engine.step, (lambda: None)
    build = time.perf_counter() - t0
    times, losses = [], []
    for i in range(args.steps):
        idx, tgt = synthetic_batch(cfg, args.batch, i)
        t = time.perf_counter()
        loss = engine(idx, tgt)
        backward(loss)
        step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    close()
    return {"variant": args.variant, "build": build, "times": times, "losses": losses, "optimizer": opt_name,
            "step": statistics.median(times[args.warmup:]), "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def launch(variant: str, args: argparse.Namespace) -> dict:
    """Run one variant in a fresh subprocess (DeepSpeed ones with the DeepSpeed interpreter)."""
    nvme = os.path.join(args.nvme, variant)
    shutil.rmtree(nvme, ignore_errors=True)
    os.makedirs(nvme, exist_ok=True)
    env = dict(os.environ)
    python = sys.executable
    if variant.startswith("ds"):
        python = args.ds_python
        env.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [python, os.path.abspath(__file__), "--variant", variant, "--nvme", nvme]
    if args.ds_zero_init:
        cmd.append("--ds-zero-init")
    for k in ("layers", "embd", "heads", "vocab", "block", "batch", "steps", "warmup"):
        cmd += [f"--{k}", str(getattr(args, k))]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
    shutil.rmtree(nvme, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-25:])
        print(f"{variant}: failed (rc {proc.returncode})\n{tail}", flush=True)
        return {"variant": variant, "failed": True}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall"] = wall
    out["disk_left"] = disk
    print(f"{variant:<10} build {out['build']:.1f}s, steps {' '.join(f'{x:.3f}' for x in out['times'])}, "
          f"optimizer {out['optimizer']}, peak RSS {out['maxrss_gib']:.2f} GiB", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nvme", default="/work/nvme-baselines")
    p.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    p.add_argument("--only", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--ds-zero-init", action="store_true",
                   help="build DeepSpeed's model under deepspeed.zero.Init (its per-parameter re-init of out.weight "
                        "is then lost: that loop runs on already-partitioned parameters, so losses differ)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    import torch

    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=args.vocab, block=args.block, n_embd=args.embd, n_head=args.heads, n_layer=args.layers)
    numel = sum(q.numel() for q in dict.fromkeys(GPT(cfg).parameters()))
    ds_version = subprocess.run([args.ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                                env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True).stdout.strip()
    print(f"GPT {numel:,} parameters (vocab {args.vocab}, block {args.block}, n_embd {args.embd}, n_head {args.heads}, "
          f"n_layer {args.layers}), batch {args.batch}, {args.steps} steps ({args.warmup} warm-up), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, DeepSpeed {ds_version or '?'}")
    res = {v: launch(v, args) for v in args.only.split(",")}
    ok = {v: r for v, r in res.items() if not r.get("failed")}

    print()
    print(f"{'run':<30}{'step s':>9}{'/ own mem':>11}{'build s':>9}{'peak RSS GiB':>14}")
    names = {"zinf-mem": "zinf in memory", "zinf-nvme": "zinf params+optim on NVMe",
             "ds-mem": "DeepSpeed ZeRO-3 in memory", "ds-nvme": "DeepSpeed ZeRO-3 NVMe/NVMe"}
    for v in res:
        if v not in ok:
            print(f"{names[v]:<30}{'failed':>9}")
            continue
        base = ok.get(v.split("-")[0] + "-mem")
        ratio = f"{ok[v]['step'] / base['step']:.2f}x" if base else "-"
        print(f"{names[v]:<30}{ok[v]['step']:>9.3f}{ratio:>11}{ok[v]['build']:>9.1f}{ok[v]['maxrss_gib']:>14.2f}")
    if "zinf-nvme" in ok and "ds-nvme" in ok:
        z, d = ok["zinf-nvme"]["step"], ok["ds-nvme"]["step"]
        print(f"\nzinf NVMe step / DeepSpeed NVMe step = {z:.3f} / {d:.3f} = {z / d:.2f}x "
              f"({'zinf faster' if z < d else 'DeepSpeed faster'})")
    if ok:
        n = min(4, args.steps)
        print(f"\nloss, first {n} steps:")
        for v, r in ok.items():
            print(f"  {names[v]:<30}" + " ".join(f"{x:.4f}" for x in r["losses"][:n]))
        first = [r["losses"][0] for r in ok.values()]
        spread = max(first) - min(first)
        print(f"  step-0 loss spread across engines: {spread:.2e} ({'agree' if spread < 1e-3 else 'DIFFER'})")


if __name__ == "__main__":
    main()
