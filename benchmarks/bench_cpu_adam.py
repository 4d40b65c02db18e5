"""CPU Adam benchmark: zinf's fused adam_step vs torch AdamW (fused / default) vs a streaming bound.

    python benchmarks/bench_cpu_adam.py [--sizes 100M,500M] [--threads 2] [--reps 3]

Table 1: one AdamW step on N fp32 params (G params/s). "streaming bound" moves the same 28 bytes
per param as Adam (read p, g, m, v; write p, m, v) with trivial math, in the same run. Two rows add the CRC32C an
NVMe sub-group's records need (the four arrays as read, the three as written): taken by passes of their own, and by
``adam_step_checked`` inside the Adam pass.
Table 2: the whole ZeRO optimizer step: unscale (1/loss_scale), global-norm clip, AdamW and a bf16
copy of the param; zinf fuses it into grad_norm_sq + one adam_step pass, torch runs
g.mul_(1/S); clip_grad_norm_; fused AdamW; param_bf16.copy_(param).
Table 3: the same step as the engine runs it (``engine.step()`` of a one-group model with the optimizer
offloaded to CPU: norms from the gradient shard's statistics, taken when backward completed it; unscale and
clip applied inside the one Adam pass; the bf16/fp16 shard written by that pass; the gradient zeroed by it
for the next backward), against torch's sequence on the same numbers. Bytes per parameter are printed beside it:
the floor is 30 (read gradient, master, two moments; write master, two moments, the 2-byte shard).
Table 4: compact moments (``optimizer_storage``): the engine's step with fp32, bf16 and int8 moments (30, 22 and
18 bytes per parameter), beside the memory bandwidth the streaming bound measures in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness.machine import best_seconds  # noqa: E402
from zinf import native  # noqa: E402
from zinf.native.checked_adam import adam_step_checked


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s.rstrip("KMG")) * mult)


def bench_size(n: int, reps: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    hyper = native.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    p = torch.randn(n)
    g = torch.randn(n)
    m = torch.zeros(n)
    v = torch.zeros(n)
    step = [0]

    def ours() -> None:
        step[0] += 1
        native.adam_step(p, g, m, v, hyper, step=step[0])

    def checked_apart() -> None:  # an NVMe record's content check and write stamp as passes of their own
        for t in (p, m, v, g):
            native.crc32c(t, threads=native.require().adam.num_threads())
        ours()
        for t in (p, m, v):
            native.crc32c(t, threads=native.require().adam.num_threads())

    def checked_in_pass() -> None:  # the same CRC32C values taken tile by tile inside the Adam pass
        step[0] += 1
        adam_step_checked(p, g, m, v, hyper, step=step[0], grad_checksum=True)

    rows = [("streaming bound (28 B/param)", best_seconds(lambda: native.stream_bound(p, g, m, v), reps)),
            ("zinf adam_step", best_seconds(ours, reps)),
            ("zinf adam_step + CRC32C of what it reads and writes, apart", best_seconds(checked_apart, reps)),
            ("zinf adam_step_checked (the CRC32C in the pass)", best_seconds(checked_in_pass, reps))]
    del m, v
    gc.collect()
    for name, kw in (("torch AdamW(fused=True)", dict(fused=True)), ("torch AdamW (default, foreach)", dict(foreach=True))):
        param = torch.nn.Parameter(p)
        param.grad = g
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)  # type: ignore[arg-type]
        rows.append((name, best_seconds(opt.step, reps)))
        del opt, param
        gc.collect()

    # whole ZeRO step
    loss_scale, max_norm = 1024.0, 1.0
    m = torch.zeros(n)
    v = torch.zeros(n)
    p_bf16 = torch.empty(n, dtype=torch.bfloat16)

    def ours_full() -> None:
        step[0] += 1
        sq, finite = native.grad_norm_sq(g)
        norm = (sq**0.5) / loss_scale
        clip = min(1.0, max_norm / (norm + 1e-6)) if finite else 0.0
        native.adam_step(p, g, m, v, hyper, step=step[0], grad_scale=loss_scale, clip_coef=clip, param_out=p_bf16)

    full = [("zinf fused (norm + adam_step)", best_seconds(ours_full, reps))]
    del m, v
    gc.collect()
    param = torch.nn.Parameter(p)
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    g_work = g.clone()

    def torch_full() -> None:
        param.grad = g_work
        g_work.mul_(1.0 / loss_scale)
        torch.nn.utils.clip_grad_norm_([param], max_norm)
        opt.step()
        p_bf16.copy_(param)

    full.append(("torch: unscale, clip_grad_norm_, fused AdamW, bf16 copy", best_seconds(torch_full, reps)))
    return rows, full


def bench_engine_step(n: int, reps: int, precision: str) -> list[tuple[str, float, float]]:
    """(name, seconds per step, bytes per parameter moved) for zinf's engine.step() and torch's sequence."""
    import zinf
    from torch import nn

    rows = 1024
    loss_scale = 1024.0 if precision == "fp16" else 1.0
    cfg = zinf.ZeroConfig.from_dict({
        "precision": precision, "gradient_clipping": 1.0, "log_every_n_steps": 0,
        "loss_scale": {"initial_scale": loss_scale, "growth_interval": 10**9},
        "offload": {"optimizer": "cpu", "overlap_optimizer": False, "sub_group_numel": 32 << 20}})
    torch.manual_seed(0)
    model = nn.Linear(n // rows, rows, bias=False)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), cfg)
    x = torch.randn(1, n // rows)

    def backward() -> None:  # a real backward: the gradient lands in the shard and its norms are taken there
        engine.backward(engine(x).float().sum())

    def step() -> None:
        engine.step()

    backward()
    step()
    best = float("inf")
    for _ in range(reps):
        backward()
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    group = engine.groups[0]
    grad = torch.randn(group.shard_numel)
    stats = best_seconds(lambda: torch.linalg.vector_norm(grad), reps)  # what GradShard.complete() adds to backward
    engine.close()
    del engine, model
    gc.collect()

    param = torch.nn.Parameter(torch.randn(n))
    g_work = torch.randn(n)
    low = torch.empty(n, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)

    def torch_step() -> None:
        param.grad = g_work
        if loss_scale != 1.0:
            g_work.mul_(1.0 / loss_scale)
        torch.nn.utils.clip_grad_norm_([param], 1.0)
        opt.step()
        low.copy_(param)

    torch_bytes = (8 if loss_scale != 1.0 else 0) + 4 + 8 + 28 + 6  # unscale, norm, clip multiply, AdamW, copy
    out = [("zinf engine.step() (one fused pass, gradient zeroed in it)", best, 30),
           ("  + norm taken at gradient completion (in backward)", best + stats, 30 + 4),
           ("torch: " + ("unscale, " if loss_scale != 1.0 else "") + "clip_grad_norm_, fused AdamW, low-precision copy",
            best_seconds(torch_step, reps), torch_bytes)]
    del opt, param, g_work
    gc.collect()
    return out


def _storage_engine(n: int, storage: str):
    """A one-group model (bf16 parameters, optimizer on CPU, moments kept as ``storage``) and its backward."""
    import zinf
    from torch import nn

    cfg = zinf.ZeroConfig.from_dict({
        "precision": "bf16", "gradient_clipping": 1.0, "optimizer_storage": storage,
        "offload": {"optimizer": "cpu", "overlap_optimizer": False, "sub_group_numel": 32 << 20}})
    torch.manual_seed(0)
    model = nn.Linear(n // 1024, 1024, bias=False)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), cfg)
    x = torch.randn(1, n // 1024)
    return engine, lambda: engine.backward(engine(x).float().sum())


def print_storage_table(n: int, reps: int) -> None:
    """The engine's step with each moment storage, the engines' steps interleaved rep by rep (a shared machine's
    memory bandwidth drifts: every storage sees the same drift), best of ``max(reps, 7)``."""
    p, g, m, v = (torch.randn(n) for _ in range(4))
    bound = best_seconds(lambda: native.stream_bound(p, g, m, v), reps)
    bandwidth = 28 * n / bound
    del p, g, m, v
    gc.collect()
    storages = {"fp32": 30, "bf16": 22, "int8": 18}
    engines = {s: _storage_engine(n, s) for s in storages}
    best = dict.fromkeys(storages, float("inf"))
    for rep in range(max(reps, 7) + 1):
        for s, (engine, backward) in engines.items():
            backward()
            t0 = time.perf_counter()
            engine.step()
            if rep:  # the first step of each is a warm-up
                best[s] = min(best[s], time.perf_counter() - t0)
    for engine, _ in engines.values():
        engine.close()
    print(f"\n## Compact moments (optimizer_storage), bf16 parameters, {n / 1e6:.0f}M params (best of {max(reps, 7)}, "
          "interleaved)")
    print("| step | s/step | G params/s | bytes/param moved | GB/s | share of the measured bandwidth | params/s vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s, nbytes in storages.items():
        t = best[s]
        print(f"| zinf engine.step(), {s} moments | {t:.4f} | {n / t / 1e9:.3f} | {nbytes} | {nbytes * n / t / 1e9:.1f} | "
              f"{nbytes * n / t / bandwidth * 100:.0f}% | {best['fp32'] / t:.2f}x |")
    print(f"\nmemory bandwidth measured by the streaming bound (28 bytes/param, trivial math): {bandwidth / 1e9:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100M,500M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine-only", action="store_true", help="only table 3 (the engine's step against torch)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_num_threads(args.threads)
    info = native.info()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"zinf native={info.available} simd={info.simd_level}")
    try:
        import deepspeed  # noqa: F401

        print("deepspeed importable, but its CPU Adam column is not wired in this script")
    except Exception:
        print("deepspeed: not installed (column omitted)")
    for s in args.sizes.split(","):
        n = parse_size(s)
        for precision in ("bf16", "fp16"):
            table = bench_engine_step(n, args.reps, precision)
            print(f"\n## The ZeRO step as the engine runs it ({precision}), {n / 1e6:.0f}M params (best of {args.reps})")
            print("| method | s/step | G params/s | bytes/param moved | GB/s | time / zinf step |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, t, nbytes in table:
                print(f"| {name} | {t:.4f} | {n / t / 1e9:.3f} | {nbytes} | {nbytes * n / t / 1e9:.1f} | "
                      f"{t / table[0][1]:.2f}x |")
            print(f"\nfloor: 30 bytes/param for the step (the engine's pass moves exactly that, zeroing the gradient for "
                  f"the next backward as it reads it); torch's sequence moves {table[-1][2]}. zinf engine.step() is "
                  f"{table[-1][1] / table[0][1]:.2f}x torch's sequence, {table[-1][1] / table[1][1]:.2f}x with the norm "
                  "taken in backward counted in.")
        print_storage_table(n, args.reps)
        if args.engine_only:
            continue
        rows, full = bench_size(n, args.reps)
        bound = rows[0][1]
        ours = rows[1][1]
        fused = next(t for name, t in rows if name.startswith("torch AdamW(fused"))
        print(f"\n## AdamW step, {n / 1e6:.0f}M fp32 params (best of {args.reps})")
        print(f"| method | s/step | G params/s | GB/s (28 B/param) | ours vs this |")
        print("|---|---:|---:|---:|---:|")
        for name, t in rows:
            print(f"| {name} | {t:.4f} | {n / t / 1e9:.3f} | {28 * n / t / 1e9:.1f} | {t / ours:.2f}x |")
        print(f"\nzinf adam_step = {bound / ours * 100:.1f}% of the streaming bound; {fused / ours:.2f}x torch fused AdamW")
        print(f"\n## Whole ZeRO step (unscale + clip + AdamW + bf16 copy), {n / 1e6:.0f}M params")
        print("| method | s/step | G params/s | speedup of zinf |")
        print("|---|---:|---:|---:|")
        for name, t in full:
            print(f"| {name} | {t:.4f} | {n / t / 1e9:.3f} | {t / full[0][1]:.2f}x |")
        gc.collect()


if __name__ == "__main__":
    main()
