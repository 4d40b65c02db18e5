"""A frozen linear layer stored in bf16 and computed in fp32 on one CPU thread: widened whole and multiplied by
``F.linear`` (the default), against multiplied tile by tile from its stored weight (``tiling.frozen_tile_bytes``,
[Note: frozen linears from storage] in zinf/frozen_linear.py).

    python benchmarks/bench_frozen_linear.py [--tokens 64 --tile-kib 1024,4096 --shapes 13824x5120,5120x13824]

For each weight shape (out x in) and a short input (``--tokens`` rows, a LoRA step's micro-batch): GFLOP/s of the
forward and of the input's gradient, the best of ``--repeats`` timings each:
- ``widen + F.linear``: the fp32 copy of the weight written into a buffer kept from one call to the next (as
  ``overlap.gather_cache`` keeps it), then multiplied;
- ``F.linear``: the multiplication alone, the fp32 weight already in memory (DDP holding the model in fp32);
- ``tiles N KiB``: ``zinf.frozen_linear.linear_in_tiles``, widening N KiB of weight at a time.
The last column compares each tiled figure with ``widen + F.linear``. The first line is the square-matrix rate
(n = 2048) the other benchmarks call this machine's peak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness.machine import matmul_peak_flops  # noqa: E402
from zinf.frozen_linear import linear_in_tiles, tile_rows  # noqa: E402


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _rates(out_f: int, in_f: int, tokens: int, tile_kib: list[int], repeats: int) -> list[tuple[str, float, float]]:
    g = torch.Generator().manual_seed(0)
    stored = torch.randn(out_f, in_f, generator=g).bfloat16()
    widened = torch.empty(out_f, in_f)
    x = torch.randn(tokens, in_f, generator=g)
    grad = torch.randn(tokens, out_f, generator=g)
    flops = 2.0 * tokens * out_f * in_f

    def widen_forward() -> object:
        widened.copy_(stored)
        return torch.nn.functional.linear(x, widened)

    def widen_backward() -> object:
        widened.copy_(stored)
        return grad @ widened

    rows = [("widen + F.linear", flops / _best(widen_forward, repeats), flops / _best(widen_backward, repeats))]
    widened.copy_(stored)
    rows.append(("F.linear", flops / _best(lambda: torch.nn.functional.linear(x, widened), repeats),
                 flops / _best(lambda: grad @ widened, repeats)))
    x_req = x.clone().requires_grad_()
    for kib in tile_kib:
        r = tile_rows(in_f, kib << 10)
        fwd = flops / _best(lambda: linear_in_tiles(x, stored, None, r), repeats)
        y = linear_in_tiles(x_req, stored, None, r)
        bwd = flops / _best(lambda: torch.autograd.grad(y, x_req, grad, retain_graph=True), repeats)
        rows.append((f"tiles {kib} KiB ({r} rows)", fwd, bwd))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--shapes", default="13824x5120,5120x13824,5120x5120,5632x2048,2048x5632",
                   help="weights as OUTxIN, comma-separated")
    p.add_argument("--tile-kib", default="1024,4096", help="tile sizes to try, KiB of fp32 weight")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (1: one rank of a 2-core box)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peak = matmul_peak_flops(n=2048, repeats=3)
    print(f"square matmul (n=2048, fp32, {args.threads} thread(s)): {peak / 1e9:.1f} GFLOP/s")
    print(f"\n| weight (out x in) | way | forward GFLOP/s | input grad GFLOP/s | / widen + F.linear (fwd, grad) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        out_f, in_f = (int(v) for v in shape.split("x"))
        rows = _rates(out_f, in_f, args.tokens, [int(k) for k in args.tile_kib.split(",")], args.repeats)
        base = rows[0]
        for way, fwd, bwd in rows:
            print(f"| {out_f} x {in_f} | {way} | {fwd / 1e9:.1f} | {bwd / 1e9:.1f} | "
                  f"{fwd / base[1]:.2f}x, {bwd / base[2]:.2f}x |")


if __name__ == "__main__":
    main()
