"""Working memory of a large linear layer with and without tiling, and activation bytes with checkpointing.

    python benchmarks/bench_tiling.py [--width 4096 --tiles 1,2,4,8,16 --steps 4]

Part 1 (2 gloo ranks): one ``width x width`` linear layer between two small ones, trained with zinf
untiled and tiled into N tiles (``tiling.tiles = [1, N]``, prefetch one module ahead): the peak bytes of
full parameters gathered at once on a rank (``StepReport.peak_gathered_bytes``) and the step time,
each against the untiled layer. Then a gather budget (``overlap.max_gathered_bytes``) below the untiled
layer: the untiled run is refused with its error, the tiled run trains under the budget.

Part 2 (2 gloo ranks): a GPT-style model, activation checkpointing off / on / on with the block inputs
in host memory: bytes autograd keeps between forward and backward (``zinf.ActivationMeter``, plus the
block inputs the checkpoint keeps, by tier) and the step time. On a CPU-only machine "device" and
"cpu" are the same memory; the split shows where the bytes would live with a GPU. With CUDA, the
``torch.cuda`` peak allocated bytes of the step are printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

MiB = 2**20


class Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.wide, self.out = nn.Linear(64, width), nn.Linear(width, width), nn.Linear(width, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.wide(torch.relu(self.inp(x)))
        return nn.functional.cross_entropy(self.out(torch.relu(h)), y)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _layer_run(rank: int, world: int, width: int, tiles: int, steps: int, budget: int) -> dict:
    torch.manual_seed(0)
    settings: dict = {"overlap": {"prefetch_modules": 1, "max_gathered_bytes": budget}}
    if tiles > 1:
        settings["tiling"] = {"min_numel": width * width, "tiles": [1, tiles]}
    model = Wide(width)
    try:
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), settings)
    except zinf.ZinfError as exc:
        return {"error": str(exc)}
    g = torch.Generator().manual_seed(rank)
    times, peaks = [], []
    try:
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=g).to(engine.device), torch.randint(0, 16, (32,), generator=g).to(engine.device)
            t = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            times.append(time.perf_counter() - t)
            peaks.append(engine.report().peak_gathered_bytes)
    except zinf.ZinfError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()
    return {"time": statistics.median(times[1:]), "peak": max(peaks[1:])}


def _gpt_run(rank: int, world: int, cfg: GPTConfig, batch: int, steps: int, mode: str) -> dict:
    torch.manual_seed(0)
    settings: dict = {}
    if mode != "off":
        settings["activation_checkpointing"] = {"modules": ["Block"], "offload": mode == "offload"}
    with zinf.Init(zinf.ZeroConfig.from_dict(settings)):
        model = GPT(cfg)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), settings)
    times, held, cuda_peak = [], {}, 0
    for step in range(steps):
        idx, tgt = (t.to(engine.device) for t in synthetic_batch(cfg, batch, step, rank))
        if torch.cuda.is_available():  # pragma: no cover - GPU only
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with zinf.ActivationMeter() as meter:
            loss = engine(idx, tgt)
        held = dict(meter.bytes)
        if engine.checkpointing is not None:
            for tier, n in engine.checkpointing.held_bytes.items():
                held[f"{tier} (block inputs)"] = n
        engine.backward(loss)
        engine.step()
        if torch.cuda.is_available():  # pragma: no cover - GPU only
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated()
        times.append(time.perf_counter() - t)
    engine.close()
    return {"time": statistics.median(times[1:]), "held": held, "cuda_peak": cuda_peak}


def _entry(rank: int, world: int, tmp: str, fn, args: tuple, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():  # pragma: no cover
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save(result, f"{tmp}/result.pt")
    finally:
        dist.destroy_process_group()


def on_ranks(fn, *args, world: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, tmp, fn, args, {}), nprocs=world, start_method="spawn")
        return torch.load(f"{tmp}/result.pt", weights_only=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--tiles", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    a = p.parse_args()
    where = "CUDA" if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"2 ranks ({where}), torch {torch.__version__}\n")

    layer = a.width * a.width * 4
    print(f"## One {a.width} x {a.width} linear layer ({layer / MiB:.0f} MiB fp32), prefetch one module ahead\n")
    print("| tiles | peak gathered MiB | vs untiled | s/step | vs untiled |\n|---:|---:|---:|---:|---:|")
    base = None
    for n in [int(t) for t in a.tiles.split(",")]:
        r = on_ranks(_layer_run, a.width, n, a.steps, 0)
        base = base or r
        print(f"| {n} | {r['peak'] / MiB:.1f} | {r['peak'] / base['peak']:.2f} | {r['time']:.3f} | "
              f"{r['time'] / base['time']:.2f}x |")
    budget = layer * 3 // 8
    n = max(int(t) for t in a.tiles.split(","))
    print(f"\n## Gather budget overlap.max_gathered_bytes = {budget / MiB:.0f} MiB (the layer alone needs {layer / MiB:.0f} MiB)\n")
    untiled = on_ranks(_layer_run, a.width, 1, a.steps, budget)
    print(f"- untiled: {untiled.get('error', 'trained (unexpected)')}")
    tiled = on_ranks(_layer_run, a.width, n, a.steps, budget)
    print(f"- {n} tiles: " + (f"trained, peak gathered {tiled['peak'] / MiB:.1f} MiB <= {budget / MiB:.0f} MiB, "
                             f"{tiled['time']:.3f} s/step" if "peak" in tiled else tiled["error"]))

    cfg = GPTConfig(vocab=4096, block=a.block, n_embd=a.embd, n_head=8, n_layer=a.layers)
    print(f"\n## GPT ({a.layers} blocks, width {a.embd}, {a.batch}x{a.block} tokens per rank): bytes kept from forward "
          "to backward\n")
    print("| checkpointing | saved tensors MiB | block inputs MiB (tier) | total MiB | vs off | s/step | vs off |"
          + (" CUDA peak MiB |" if torch.cuda.is_available() else "") + "\n|---|---:|---:|---:|---:|---:|---:|"
          + ("---:|" if torch.cuda.is_available() else ""))
    off = None
    for mode in ("off", "on", "offload"):
        r = on_ranks(_gpt_run, cfg, a.batch, a.steps, mode)
        saved = sum(v for k, v in r["held"].items() if "block inputs" not in k)
        inputs = {k.split()[0]: v for k, v in r["held"].items() if "block inputs" in k}
        total = saved + sum(inputs.values())
        off = off or (total, r["time"])
        label = {"off": "off", "on": "on", "offload": "on, inputs in host memory"}[mode]
        ins = ", ".join(f"{v / MiB:.1f} ({k})" for k, v in inputs.items()) or "-"
        row = (f"| {label} | {saved / MiB:.1f} | {ins} | {total / MiB:.1f} | {total / off[0]:.2f} | {r['time']:.3f} | "
               f"{r['time'] / off[1]:.2f}x |")
        if torch.cuda.is_available():  # pragma: no cover
            row += f" {r['cuda_peak'] / MiB:.0f} |"
        print(row)


if __name__ == "__main__":
    main()
