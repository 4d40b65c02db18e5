"""CPU Adam benchmark: zinf's fused adam_step vs torch AdamW (fused / default) vs a streaming bound.

    python benchmarks/bench_cpu_adam.py [--sizes 100M,500M] [--threads 2] [--reps 3]

Table 1: one AdamW step on N fp32 params (G params/s). "streaming bound" moves the same 28 bytes
per param as Adam (read p, g, m, v; write p, m, v) with trivial math, in the same run.
Table 2: the whole ZeRO optimizer step: unscale (1/loss_scale), global-norm clip, AdamW and a bf16
copy of the param; zinf fuses it into grad_norm_sq + one adam_step pass, torch runs
g.mul_(1/S); clip_grad_norm_; fused AdamW; param_bf16.copy_(param).
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from collections.abc import Callable

import torch

from zinf import native


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1], 1)
    return int(float(s.rstrip("KMG")) * mult)


def timeit(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up (first touch, lazy state)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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

    rows = [("streaming bound (28 B/param)", timeit(lambda: native.stream_bound(p, g, m, v), reps)),
            ("zinf adam_step", timeit(ours, reps))]
    del m, v
    gc.collect()
    for name, kw in (("torch AdamW(fused=True)", dict(fused=True)), ("torch AdamW (default, foreach)", dict(foreach=True))):
        param = torch.nn.Parameter(p)
        param.grad = g
        opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)  # type: ignore[arg-type]
        rows.append((name, timeit(opt.step, reps)))
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

    full = [("zinf fused (norm + adam_step)", timeit(ours_full, reps))]
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

    full.append(("torch: unscale, clip_grad_norm_, fused AdamW, bf16 copy", timeit(torch_full, reps)))
    return rows, full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100M,500M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
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
        rows, full = bench_size(n, args.reps)
        bound = rows[0][1]
        ours = rows[1][1]
        fused = rows[2][1]
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
