"""The host work of a training step: what the Python around the kernels costs, where a GPU would wait.

    python benchmarks/bench_host_overhead.py [--models gpt2:host,llama:host,gpt:host --worlds 1,2 --steps 30]
    python benchmarks/bench_host_overhead.py --smoke        # seconds (CI runs it)

The models have real module trees (transformers' GPT-2 and Llama, the GPT of examples/gpt.py, 12 blocks) at a
negligible width (n_embd 16, sequence 8, batch 2 per rank), so that a step is host work alone: on a GPU the
kernels of such a step would finish long before the Python that launches them. Every system is built in the same
processes (one per rank, gloo, one thread each) and they take turns step by step, so that the machine's drift hits
them alike. Systems: plain PyTorch (each rank trains its own rows, no communication: the floor), FSDP2
(``fully_shard`` per block, then the root) and zinf (its defaults, and its main settings).

Per step, medians over the timed steps: host milliseconds of forward, backward and optimizer step (wall time on
the host), and from one step counted (after the warm-up, before the timed ones; see
benchmarks/harness/host_counts.py): aten
operations, collectives as the backend receives them (a coalesced collective counts once), stream and event calls,
and the blocking syncs a GPU would pay in forward + backward (the device placement replayed on the CPU). Counts are
deterministic; tests/benchmarks/test_host_overhead.py asserts them. Collectives are counted as the backend receives
them, those that carry device tensors (with NCCL, NCCL's) apart from those of host tensors only (zinf's control
messages, which go over a gloo group beside NCCL: [Note: host-side agreement] in zinf/runtime/comm.py); zinf's
gather policy is the same on both backends. zinf runs with ``overlap.shared_memory: off``: a GPU's collectives go
through the process group, never through the shared memory of CPU ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from harness import models  # noqa: E402
from harness.host_counts import HostWork  # noqa: E402

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# the collectives of a GPU run: through the process group, never the shared memory of CPU ranks on one host
_AS_ON_A_GPU: dict[str, Any] = {"overlap": {"shared_memory": "off"}}
ZINF_SETTINGS: dict[str, dict[str, Any]] = {
    "zinf": {**_AS_ON_A_GPU},
    "zinf-noext": {**_AS_ON_A_GPU, "detect_external_params": False},
    "zinf-modules": {**_AS_ON_A_GPU, "unit_policy": "modules"},
}
LABELS = {"plain": "plain PyTorch (no communication)", "fsdp2": "FSDP2 (fully_shard per block + root)",
          "zinf": "zinf defaults", "zinf-noext": "zinf, detect_external_params off",
          "zinf-modules": "zinf, unit_policy modules"}
SYSTEMS = ("plain", "fsdp2", *ZINF_SETTINGS)
BATCH_PER_RANK = 2


class System:
    """One system set up on this rank: ``forward``, ``backward``, ``step`` as a user's loop calls them."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any], backward: Callable[[Any], None],
                 step: Callable[[], None], spec: models.ModelSpec) -> None:
        self.model, self.forward, self.backward, self.step = model, forward, backward, step
        self.loss = models.loss_fn(spec)


def build(name: str, spec: models.ModelSpec, world: int) -> System:
    torch.manual_seed(0)
    if name in ZINF_SETTINGS:
        import zinf

        config = zinf.ZeroConfig.from_dict(ZINF_SETTINGS[name])
        with zinf.Init(config):
            model = models.build(spec)
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), **ADAMW), config)
        return System(model, engine, engine.backward, engine.step, spec)
    with torch.device("cpu"):  # the compute device: its parameters live there (see harness/host_counts.py)
        model = models.build(spec)
    call: Callable[..., Any] = model
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in models.blocks(model, spec):
            fully_shard(block, mesh=mesh)
        call = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return System(model, call, lambda loss: loss.backward(), step, spec)


def timed_step(system: System, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    loss = system.loss(system.forward, idx, tgt)
    t1 = time.perf_counter()
    system.backward(loss)
    t2 = time.perf_counter()
    system.step()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def counted_step(work: HostWork, system: System, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, Any]:
    """One step under the counters: forward + backward counted for syncs, the whole step for the rest."""
    with work.counting(system.model):
        work.on_device(idx, tgt)
        loss = system.loss(system.forward, idx, tgt)
        system.backward(loss)
        fwd_bwd_syncs = dict(work.counts.syncs)
        system.step()
    out = work.counts.as_dict()
    out["syncs_forward_backward"] = fwd_bwd_syncs
    out["num_syncs_forward_backward"] = sum(fwd_bwd_syncs.values())
    return out


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: list[dict[str, Any]] = []
    try:
        for model_name in args.models:
            spec = models.parse(model_name)
            models.import_model_code(spec)
            work = HostWork()
            with work.tracking():  # placements replayed from the start (see harness/host_counts.py)
                systems = {name: build(name, spec, world) for name in args.systems}
                for step in range(args.warmup):  # the first is zinf's recorded step
                    idx, tgt = models.batch(spec, BATCH_PER_RANK * world, step, rank, world)
                    work.on_device(idx, tgt)
                    for system in systems.values():
                        timed_step(system, idx, tgt)
            idx, tgt = models.batch(spec, BATCH_PER_RANK * world, args.warmup, rank, world)
            counted = {name: counted_step(work, system, idx, tgt) for name, system in systems.items()}
            times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in systems}
            for step in range(args.warmup + 1, args.warmup + 1 + args.steps):
                idx, tgt = models.batch(spec, BATCH_PER_RANK * world, step, rank, world)
                for name, system in systems.items():
                    times[name].append(timed_step(system, idx, tgt))
            for name in systems:
                row: dict[str, Any] = {"model": model_name, "world": world, "system": name, **counted[name]}
                if name in times:
                    phases = list(zip(*times[name]))
                    row.update(forward_ms=statistics.median(phases[0]), backward_ms=statistics.median(phases[1]),
                               optimizer_ms=statistics.median(phases[2]),
                               step_ms=statistics.median([sum(t) for t in times[name]]))
                results.append(row)
            del systems
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | world | system | forward ms | backward ms | optimizer ms | step ms | vs FSDP2 | syncs fwd+bwd "
             "| collectives (device / host) | stream/event calls | aten ops |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fsdp = {(r["model"], r["world"]): r for r in rows if r["system"] == "fsdp2"}
    for r in rows:
        ref = fsdp.get((r["model"], r["world"]))
        timed = "step_ms" in r
        ratio = f"{r['step_ms'] / ref['step_ms']:.2f}x" if timed and ref and "step_ms" in ref else ""
        ms = (lambda k: f"{r[k]:.2f}" if timed else "")
        lines.append(f"| {r['model']} | {r['world']} | {LABELS[r['system']]} | {ms('forward_ms')} | {ms('backward_ms')} "
                     f"| {ms('optimizer_ms')} | {ms('step_ms')} | {ratio} | {r['num_syncs_forward_backward']} "
                     f"| {r['num_collectives']} / {r['num_host_collectives']} | {r['stream_calls']} | {r['aten_ops']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="default gpt2:host,llama:host,gpt:host (smoke: gpt2:host)")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="", help="folder for host_overhead.json and host_overhead.md")
    parser.add_argument("--smoke", action="store_true", help="one model, 2 timed steps (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.steps, args.warmup = args.models or "gpt2:host", 2, 2
    args.models = args.models or "gpt2:host,llama:host,gpt:host"
    args.models = args.models.split(",")
    args.systems = args.systems.split(",")
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            port = 29000 + os.getpid() % 1000 + world
            mp.start_processes(run_rank, args=(world, port, args, path), nprocs=world, start_method="spawn")
            with open(path) as f:
                rows += json.load(f)
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
            f.write(f"`python benchmarks/bench_host_overhead.py {' '.join(sys.argv[1:])}`\n\n{text}\n")


if __name__ == "__main__":
    main()
