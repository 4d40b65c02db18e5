"""What agreeing on collectives costs (see [Note: rounds] in zinf/schedule/rounds.py): 2 gloo ranks,
torch DDP vs zinf on the same model and global batch, in the same processes, taking turns step by step.

    python benchmarks/bench_rounds.py [--layers 4 --embd 256 --batch 8 --steps 8]
    python benchmarks/bench_rounds.py --smoke        # seconds: a tiny model, 3 steps (CI runs it)

Rows: a dense GPT, and the same GPT with a top-1 mixture-of-experts MLP (8 experts, routing that differs
per rank). Columns: seconds per step (median after two warm-up steps), zinf (its defaults: each block
gathered as one unit, see [Note: blocks as units] in zinf/schedule/units.py) over DDP, rounds per step and
the share of zinf's step spent in them; zinf with ``unit_policy="modules"`` (every module gathered on its
own; the MoE layers adopted as units after the first step) and its rounds; zinf with
``overlap.coalesce_gathers="off"`` (one all-gather per group, where the default on gloo issues one collective
per round, see [Note: one collective per round] in zinf/runtime/collectives.py); zinf with
``overlap.reshard_after_forward`` "always" (every group resharded after its forward: nothing kept for the backward)
and "never" (every group kept gathered from its forward to its backward; see [Note: kept for backward] in
zinf/schedule/keep.py). Ratios are against zinf's defaults.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import zinf  # noqa: E402
from models import GPT, GPTConfig  # noqa: E402
from patterns import MoEGPT, token_batches  # noqa: E402


MODES = {"ddp": {}, "zinf": {}, "zinf-modules": {"unit_policy": "modules"},
         "zinf-per-group": {"overlap": {"coalesce_gathers": "off"}},
         "zinf-always": {"overlap": {"reshard_after_forward": "always"}},
         "zinf-never": {"overlap": {"reshard_after_forward": "never"}}}


def _model(kind: str, cfg: GPTConfig) -> torch.nn.Module:
    return GPT(cfg) if kind == "dense" else MoEGPT(cfg)


def _setup(mode: str, kind: str, cfg: GPTConfig) -> tuple:
    """(call, backward, step, engine or None) for one mode, from seed 0."""
    torch.manual_seed(0)
    if mode.startswith("zinf"):
        with zinf.Init():
            model = _model(kind, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = zinf.initialize(model, opt, MODES[mode])
        return engine, engine.backward, engine.step, engine
    model = _model(kind, cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=kind != "dense")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return ddp, (lambda loss: loss.backward()), step, None


def _worker(rank: int, world: int, path: str, kind: str, cfg: GPTConfig, batch: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    data = token_batches(steps, batch, cfg.vocab, cfg.block)
    runs = {mode: _setup(mode, kind, cfg) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    rounds: dict[str, list[tuple[int, float]]] = {mode: [] for mode in MODES}
    for x, y in data:  # the modes take turns step by step, so that the machine's drift touches each alike
        for mode, (run, back, step, engine) in runs.items():
            dist.barrier()
            t = time.perf_counter()
            back(run(x.chunk(world)[rank], y.chunk(world)[rank]))
            step()
            times[mode].append(time.perf_counter() - t)
            if engine is not None:
                report = engine.report()
                rounds[mode].append((report.counts.get("rounds", 0), report.seconds.get("rounds", 0.0)))
    results = {mode: (statistics.median(times[mode][2:]), rounds[mode][2:]) for mode in MODES}
    for _, _, _, engine in runs.values():
        if engine is not None:
            engine.close()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="a tiny model (2 layers, embd 32, batch 2), 3 steps")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.embd, a.batch, a.steps = 2, 32, 2, 3
    cfg = GPTConfig(vocab=4096 if not a.smoke else 256, block=128 if not a.smoke else 16, n_embd=a.embd,
                    n_head=8, n_layer=a.layers)
    print(f"2 gloo ranks, 1 thread each, batch {a.batch}x{cfg.block}, {a.layers} layers, embd {a.embd}")
    print("\n| model | params | DDP s/step | zinf s/step | zinf / DDP | rounds/step | rounds share "
          "| module by module s/step | that / zinf | its rounds/step | one all-gather per group s/step | that / zinf "
          "| reshard always s/step | that / zinf | reshard never s/step | that / zinf |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("dense", "moe"):
        numel = sum(q.numel() for q in dict.fromkeys(_model(kind, cfg).parameters()))
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.pt")
            mp.start_processes(_worker, args=(2, os.path.join(d, "rdv"), kind, cfg, a.batch, a.steps, out),
                               nprocs=2, start_method="spawn")
            res = torch.load(out, weights_only=False)
        ddp, (zt, rounds) = res["ddp"][0], res["zinf"]
        mt, mrounds = res["zinf-modules"]
        per_group, always, never = (res[m][0] for m in ("zinf-per-group", "zinf-always", "zinf-never"))
        n = statistics.median(r[0] for r in rounds)
        share = statistics.median(r[1] for r in rounds) / zt
        mn = statistics.median(r[0] for r in mrounds)
        print(f"| {kind} | {numel / 1e6:.1f}M | {ddp:.4f} | {zt:.4f} | {zt / ddp:.2f}x | {n:.0f} | {share:.1%} "
              f"| {mt:.4f} | {mt / zt:.2f}x | {mn:.0f} | {per_group:.4f} | {per_group / zt:.2f}x "
              f"| {always:.4f} | {always / zt:.2f}x | {never:.4f} | {never / zt:.2f}x |")


if __name__ == "__main__":
    main()
