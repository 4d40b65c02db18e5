"""What the engine costs on one rank, where ZeRO has nothing to save: plain PyTorch vs zinf, back to back.

    python benchmarks/bench_engine.py [--layers 6 --embd 256 --batch 8 --steps 8]

Rows: plain PyTorch (AdamW), zinf with default settings, and zinf with the external-parameter mode
off (``detect_external_params=False``; the model must then not use parameters outside their module,
which this GPT does not). The ratio column is the step time over plain PyTorch's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402


def run(cfg: GPTConfig, batch: int, steps: int, zcfg: dict | None) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = zinf.initialize(model, opt, zcfg) if zcfg is not None else None
    times = []
    for step in range(steps):
        idx, tgt = synthetic_batch(cfg, batch, step)
        t = time.perf_counter()
        if engine is None:
            model(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
        else:
            engine.backward(engine(idx, tgt))
            engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    cfg = GPTConfig(vocab=4096, block=128, n_embd=a.embd, n_head=8, n_layer=a.layers)
    numel = sum(p.numel() for p in dict.fromkeys(GPT(cfg).parameters()))
    print(f"GPT {numel / 1e6:.1f}M parameters, batch {a.batch}x{cfg.block}, {torch.get_num_threads()} threads, 1 rank")
    rows = [("plain PyTorch", run(cfg, a.batch, a.steps, None)),
            ("zinf (defaults)", run(cfg, a.batch, a.steps, {})),
            ("zinf, detect_external_params off", run(cfg, a.batch, a.steps, {"detect_external_params": False}))]
    print(f"\n| run | s/step | vs plain |\n|---|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t:.4f} | {t / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
