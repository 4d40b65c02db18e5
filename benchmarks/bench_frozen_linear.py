"""A frozen linear layer stored in bf16 or NF4 and computed in fp32 on one CPU thread: widened (decoded) whole and
multiplied by ``F.linear`` (the default), against multiplied tile by tile from its stored weight
(``tiling.frozen_tile_bytes``, [Note: frozen linears from storage] in zinf/frozen_linear.py).

    python benchmarks/bench_frozen_linear.py [--tokens 64 --tile-kib 1024,4096 --formats bf16,nf4 --shapes ...]

For each format, weight shape (out x in) and a short input (``--tokens`` rows, a LoRA step's micro-batch): GFLOP/s of
the forward and of the input's gradient, the best of ``--repeats`` timings each:
- ``widen + F.linear``: the fp32 weight written into a buffer kept from one call to the next (as
  ``overlap.gather_cache`` keeps it), widened from bf16 or decoded from NF4 codes, then multiplied;
- ``F.linear``: the multiplication alone, the fp32 weight already in memory (DDP holding the model in fp32);
- ``tiles N KiB``: ``zinf.frozen_linear.linear_in_tiles``, widening (decoding) N KiB of weight at a time.
The last column compares each tiled figure with ``widen + F.linear``. The first line is the square-matrix rate
(n = 2048) the other benchmarks call this machine's peak. Then the NF4 decoding alone, nanoseconds a parameter, at
each SIMD level this CPU has (``ZINF_SIMD``): a whole 64 MiB weight into memory, and 4 MiB tiles into one buffer.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness.machine import best_seconds, matmul_peak_flops  # noqa: E402
from zinf import native  # noqa: E402
from zinf.frozen_linear import WeightRows, linear_in_tiles, tile_rows  # noqa: E402
from zinf.param.four_bit import FourBitFormat  # noqa: E402
from zinf.param.layout import ParamSlot  # noqa: E402


def _stored(fmt: str, out_f: int, in_f: int) -> tuple[Callable[[torch.Tensor], object], Callable[[], WeightRows]]:
    """The weight stored in ``fmt``: how it is widened whole into a kept fp32 buffer, and its rows for tiles."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=g)
    if fmt == "bf16":
        stored = weight.bfloat16()
        return (lambda out: out.copy_(stored)), (lambda: WeightRows.widened(stored))
    four = FourBitFormat("nf4")
    numel = out_f * in_f
    assert numel % four.blocksize == 0 and in_f % four.blocksize == 0, "an NF4 weight of whole blocks a row"
    codes = four.encode([ParamSlot("weight", weight.shape, 0, numel)], [weight], 0, numel)
    return ((lambda out: four.widen(codes, 1, numel, out.view(-1))),
            (lambda: WeightRows.decoded((out_f, in_f), four, codes, 1, numel, 0)))


def _rates(fmt: str, out_f: int, in_f: int, tokens: int, tile_kib: list[int],
           repeats: int) -> list[tuple[str, float, float]]:
    g = torch.Generator().manual_seed(1)
    widen, rows_of = _stored(fmt, out_f, in_f)
    widened = torch.empty(out_f, in_f)
    x = torch.randn(tokens, in_f, generator=g)
    grad = torch.randn(tokens, out_f, generator=g)
    flops = 2.0 * tokens * out_f * in_f

    def widen_forward() -> object:
        widen(widened)
        return torch.nn.functional.linear(x, widened)

    def widen_backward() -> object:
        widen(widened)
        return grad @ widened

    rows = [("widen + F.linear", flops / best_seconds(widen_forward, repeats), flops / best_seconds(widen_backward, repeats))]
    widen(widened)
    rows.append(("F.linear", flops / best_seconds(lambda: torch.nn.functional.linear(x, widened), repeats),
                 flops / best_seconds(lambda: grad @ widened, repeats)))
    x_req = x.clone().requires_grad_()
    for kib in tile_kib:
        r, source = tile_rows(in_f, kib << 10), rows_of()
        fwd = flops / best_seconds(lambda: linear_in_tiles(x, source, None, r), repeats)
        y = linear_in_tiles(x_req, source, None, r)
        bwd = flops / best_seconds(lambda: torch.autograd.grad(y, x_req, grad, retain_graph=True), repeats)
        rows.append((f"tiles {kib} KiB ({r} rows)", fwd, bwd))
    return rows


def _decode_rates(repeats: int) -> list[tuple[str, float, float]]:
    """NF4 decoding, ns a parameter, at each SIMD level: 16M parameters into one fp32 buffer, and in 4 MiB tiles."""
    four, numel, tile = FourBitFormat("nf4"), 16 << 20, 1 << 20
    values = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    codes = four.encode([ParamSlot("weight", values.shape, 0, numel)], [values], 0, numel)
    whole, part = torch.empty(numel), torch.empty(tile)
    levels = {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(native.info().simd_level, [])
    before, out = native.info().simd_level, []
    try:
        for level in levels:
            native.set_simd_level(level)
            w = best_seconds(lambda: four.widen(codes, 1, numel, whole), repeats)
            t = best_seconds(lambda: [four.decode_range(codes, 1, numel, a, a + tile, part) for a in range(0, numel, tile)],
                      repeats)
            out.append((level, w / numel * 1e9, t / numel * 1e9))
    finally:
        if levels:
            native.set_simd_level(before)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--shapes", default="13824x5120,5120x13824,5120x5120,5632x2048,2048x5632",
                   help="weights as OUTxIN, comma-separated")
    p.add_argument("--formats", default="bf16,nf4", help="how the weight is stored: bf16, nf4 (comma-separated)")
    p.add_argument("--tile-kib", default="1024,4096", help="tile sizes to try, KiB of fp32 weight")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (1: one rank of a 2-core box)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peak = matmul_peak_flops(n=2048, repeats=3)
    print(f"square matmul (n=2048, fp32, {args.threads} thread(s)): {peak / 1e9:.1f} GFLOP/s")
    print("\n| stored | weight (out x in) | way | forward GFLOP/s | input grad GFLOP/s | / widen + F.linear (fwd, grad) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            out_f, in_f = (int(v) for v in shape.split("x"))
            rows = _rates(fmt, out_f, in_f, args.tokens, [int(k) for k in args.tile_kib.split(",")], args.repeats)
            base = rows[0]
            for way, fwd, bwd in rows:
                print(f"| {fmt} | {out_f} x {in_f} | {way} | {fwd / 1e9:.1f} | {bwd / 1e9:.1f} | "
                      f"{fwd / base[1]:.2f}x, {bwd / base[2]:.2f}x |")
    print("\n| SIMD level | NF4 decode into a 64 MiB buffer, ns/param | in 4 MiB tiles, ns/param |")
    print("| --- | ---: | ---: |")
    for level, whole, tiles in _decode_rates(args.repeats):
        print(f"| {level} | {whole:.3f} | {tiles:.3f} |")


if __name__ == "__main__":
    main()
