"""What a data-parallel step's collectives and optimizer cost alone, with no compute beside them: 2 ranks on this
host, one thread each, tensors of a model's size; gloo's collectives beside zinf's through shared memory.

    python benchmarks/bench_collectives.py [--numel 6900000 --repeats 12]

Rows (medians after two warm-up repeats, rank 0's clock, a barrier before each): an all-gather of the full
parameter vector from the shards (ZeRO-3 does two a step: forward and backward, one where the forward keeps its
groups), a reduce-scatter of the full gradient vector (ZeRO-3: one a step), an all-reduce of it (DDP: one a step),
and torch's AdamW on half the parameters (one rank's shard). The all-gather and reduce-scatter run through gloo
and through zinf's same-host transport (``overlap.shared_memory``, [Note: same-host collectives] in
zinf/runtime/same_host.py). The last lines add them up per system: what a step's communication costs where nothing
hides it (see docs/benchmarks.md, "What the collectives cost alone").
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zinf.runtime.comm import Comm
from zinf.runtime.same_host import SameHostTransport

# torch 2.13's names for the tensor-in/tensor-out collectives; older releases only have the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _worker(rank: int, world: int, path: str, numel: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    per_rank = numel // world
    shard, full = torch.randn(per_rank), torch.empty(per_rank * world)
    grad, reduced = torch.randn(per_rank * world), torch.empty(per_rank)
    param = torch.nn.Parameter(torch.randn(per_rank))
    param.grad = torch.randn(per_rank)
    opt = torch.optim.AdamW([param], lr=1e-4)
    comm = Comm.current()
    shared = comm.with_same_host(SameHostTransport.connect(comm))
    if shared.same_host is None:
        raise SystemExit("zinf's shared memory could not be set up on this host (see the log)")
    ops = {"all-gather": lambda: _all_gather(full, shard),
           "all-gather shm": lambda: shared.all_gather_into(full, shard, async_op=False),
           "reduce-scatter": lambda: _reduce_scatter(reduced, grad),
           "reduce-scatter shm": lambda: shared.reduce_scatter_sum(reduced, grad, async_op=False),
           "all-reduce": lambda: dist.all_reduce(grad),
           "AdamW on one shard": opt.step}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        torch.save({name: statistics.median(t[2:]) for name, t in times.items()}, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=6_900_000, help="parameters of the model (GPT-2 6.9M by default)")
    p.add_argument("--repeats", type=int, default=12)
    a = p.parse_args()
    if a.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (two are warm-up)")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.pt")
        mp.start_processes(_worker, args=(2, os.path.join(d, "rdv"), a.numel, a.repeats, out), nprocs=2,
                           start_method="spawn")
        ms = {name: s * 1000 for name, s in torch.load(out).items()}
    print(f"2 ranks on this host, 1 thread each, {a.numel:,} fp32 parameters, median of {a.repeats - 2}\n")
    print("| operation | gloo ms | zinf shared memory ms | shared memory / gloo |\n|---|---:|---:|---:|")
    for name in ("all-gather", "reduce-scatter", "all-reduce", "AdamW on one shard"):
        shm = ms.get(f"{name} shm")
        cells = ("-", "-") if shm is None else (f"{shm:.1f}", f"{shm / ms[name]:.2f}x")
        print(f"| {name} | {ms[name]:.1f} | {cells[0]} | {cells[1]} |")
    for label, key in (("gloo", ""), ("zinf shared memory", " shm")):
        zero3 = 2 * ms["all-gather" + key] + ms["reduce-scatter" + key]
        print(f"\nZeRO-3 step's collectives, {label} (2 all-gathers + 1 reduce-scatter): {zero3:.1f} ms; with its "
              f"optimizer {zero3 + ms['AdamW on one shard']:.1f} ms")
    print(f"\nDDP step's collective, gloo (1 all-reduce): {ms['all-reduce']:.1f} ms")

if __name__ == "__main__":
    main()
