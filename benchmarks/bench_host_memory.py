"""Host memory of an unchanged full fine-tune from ``from_pretrained``, per rank, against the model's size and the
engine's own accounting, through three front ends (a transformers ``Trainer``, an Accelerate loop, a Lightning
module): DDP beside zinf with everything on NVMe and a host budget (``offload.max_cpu_bytes``, so that it trims its heap
during the step), zinf without the trimming (``trim_heap_bytes: 0``; ``overlap.host_keep: off``, so that no room of
host memory keeps gathered groups either), and zinf with glibc told to return freed memory at once instead
(``MALLOC_MMAP_THRESHOLD_``).

    python benchmarks/bench_host_memory.py [--layers 24 --hidden 512 --intermediate 1376 --vocab 8000]
        [--steps 6] [--batch 2] [--pool-mib 64] [--systems ddp,zinf-nvme,zinf-nvme-untrimmed,zinf-nvme-mmap]
        [--front-ends trainer,accelerate,lightning] [--work-dir DIR]
    python benchmarks/bench_host_memory.py --smoke            # a tiny model, 2 steps (CI)

The scripts (harness/trainer_memory_script.py; harness/loop_memory_script.py for Accelerate and Lightning) call
``from_pretrained`` on an fp32 Llama checkpoint written by make_pretrained.py and train (2 ranks, batch 2 x 32 tokens
per rank, clipping on). DDP runs under ``accelerate launch`` (Trainer, Accelerate) or with ``strategy="ddp"``; zinf
under ``zinf launch`` (Trainer, Accelerate) or with ``ZeroInfinityStrategy`` and the same settings. Every rank
samples its RSS every 5 ms from just before ``from_pretrained``. Columns, in MiB of growth over that base: after
loading, just before the engine (or DDP) is built (the Trainer's ``Trainer(...)`` moves the model to
``args.device``), the sampled peak and the kernel's
high-water mark over the whole run, and RSS after the last step beside the engine's own host bytes then
(``engine.resident_bytes()``: the pinned pool and anything gathered), and the most the engine held during a step
(``StepReport.peak_host_bytes``, activations not counted); the worst rank of each. ``step s``: the median
wall time of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_pretrained  # noqa: E402
from harness import machine, tables  # noqa: E402

SCRIPT = HERE / "harness" / "trainer_memory_script.py"
LOOP_SCRIPT = HERE / "harness" / "loop_memory_script.py"
FRONT_ENDS = ("trainer", "accelerate", "lightning")
FRONT_END_LABELS = {"trainer": "Trainer", "accelerate": "Accelerate loop", "lightning": "Lightning"}
ACCELERATE_DDP = HERE.parent / "examples" / "accelerate" / "accelerate_cpu.yaml"
SYSTEMS = ("ddp", "zinf-nvme", "zinf-nvme-untrimmed", "zinf-nvme-mmap")
LABELS = {"ddp": "DDP", "zinf-nvme": "zinf, everything on NVMe, `max_cpu_bytes` 4 GiB",
          "zinf-nvme-untrimmed": "zinf, everything on NVMe, `trim_heap_bytes: 0`, `host_keep: off`",
          "zinf-nvme-mmap": "zinf, everything on NVMe, `trim_heap_bytes: 0`, `host_keep: off`, MALLOC_MMAP_THRESHOLD_=65536"}
MIB = 2**20
BUDGET = 4 << 30  # zinf-nvme's offload.max_cpu_bytes: host memory is what the run is short of, so the heap is trimmed
# a launch's own variables in this process's environment (a caller that ran ranks in-process, Lightning among them,
# leaves LOCAL_RANK and friends behind): passed on, they make Lightning take the run for one rank of a launch that
# already happened, and wait for the other rank for good
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "ZINF_CONFIG")
_LAUNCH_PREFIXES = ("TORCHELASTIC_", "PL_")


def _zinf_config(path: Path, nvme: Path, pool_bytes: int, trim: bool) -> Path:
    path.write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: "no"
use_cpu: true
rdzv_backend: static
same_network: true
main_training_function: main
zinf:
  offload:
    params: nvme
    optimizer: nvme
    grads: nvme
    nvme_paths: ["{nvme}"]
    pinned_pool_bytes: {pool_bytes}
    sub_group_numel: 262144
""" + (f"    max_cpu_bytes: {BUDGET}\n" if trim else "  trim_heap_bytes: 0\n  overlap:\n    host_keep: \"off\"\n"))
    return path


def run(system: str, model: Path, work: Path, steps: int, pool_bytes: int, batch: int = 2,
        front_end: str = "trainer", timeout_s: float = 1800) -> list[dict]:
    here = work / front_end / system
    out = here / "out"
    here.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update({"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})
    script = [str(SCRIPT)] if front_end == "trainer" else [str(LOOP_SCRIPT)]
    args = [*script, str(model), str(out), "--steps", str(steps), "--batch", str(batch)]
    if front_end != "trainer":
        args += ["--front-end", front_end]
    config = None
    if system != "ddp":
        nvme = here / "nvme"
        nvme.mkdir(exist_ok=True)
        config = _zinf_config(here / "zinf.yaml", nvme, pool_bytes, trim=system == "zinf-nvme")
    if front_end == "lightning":
        cmd = [sys.executable, *args] + (["--zinf-config", str(config)] if config is not None else [])
    elif config is None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_DDP), *args]
    else:
        cmd = [sys.executable, "-m", "zinf.cli", "launch", "--config", str(config), *args]
    if system == "zinf-nvme-mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its ranks in one process group, killed together
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise SystemExit(f"{front_end} {system} ran past {timeout_s:.0f} s:\n{stderr[-4000:]}") from None
    if proc.returncode != 0:
        raise SystemExit(f"{front_end} {system} failed ({proc.returncode}):\n{stderr[-4000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def row(system: str, ranks: list[dict], model_bytes: int, front_end: str = "trainer") -> dict:
    def at(r: dict, what: str) -> dict:
        return next(m for m in r["marks"] if m["what"] == what)

    steps = [[m for m in r["marks"] if m["what"].startswith("step ")] for r in ranks]
    times = [b["t"] - a["t"] for a, b in zip(steps[0], steps[0][1:])]
    last = [s[-1] for s in steps]
    peak = max(max(m["peak"] for m in r["marks"]) for r in ranks)
    hosts = [m.get("engine_host") for m in last]
    peaks = [m.get("engine_peak_host") for s in steps for m in s]
    return {"front_end": FRONT_END_LABELS[front_end], "system": LABELS[system],
            "step_s": statistics.median(times) if times else None,
            "loaded": max(at(r, "loaded")["rss"] for r in ranks) / MIB,
            "before_engine": max(at(r, "before engine")["rss"] for r in ranks) / MIB,
            "peak": peak / MIB, "hwm": max(r["hwm"] for r in ranks) / MIB, "peak_x_model": peak / model_bytes,
            "after": max(m["rss"] for m in last) / MIB,
            "engine_host": max(hosts) / MIB if all(h is not None for h in hosts) else None,
            "engine_peak": max(peaks) / MIB if peaks and all(h is not None for h in peaks) else None}


def render(meta: dict, rows: list[dict]) -> str:
    lines = [f"# host memory: {meta['model']}, {meta['model_bytes'] / MIB:.0f} MiB in fp32, 2 ranks, {meta['steps']} "
             f"steps of {meta['batch']} x 32 tokens per rank, pinned pool {meta['pool_mib']} MiB", "",
             tables.header(meta["machine"]), "",
             "| front end | system | step s | after load | before the engine | peak (sampled) | VmHWM | peak / model | "
             "after last step | engine host bytes | engine's peak in a step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        eng = f"{r['engine_host']:.0f}" if r["engine_host"] is not None else "-"
        epk = f"{r['engine_peak']:.0f}" if r["engine_peak"] is not None else "-"
        step = f"{r['step_s']:.2f}" if r["step_s"] is not None else "-"
        lines.append(f"| {r['front_end']} | {r['system']} | {step} | {r['loaded']:.0f} | {r['before_engine']:.0f} | "
                     f"{r['peak']:.0f} | "
                     f"{r['hwm']:.0f} | {r['peak_x_model']:.2f}x | {r['after']:.0f} | {eng} | {epk} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=2, help="sequences of 32 tokens per rank")
    p.add_argument("--pool-mib", type=int, default=64)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--front-ends", default="trainer", help=f"some of {','.join(FRONT_ENDS)}")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.vocab, a.steps = 2, 128, 256, 1000, 2
    systems, front_ends = a.systems.split(","), a.front_ends.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) {sorted(unknown)}: expected some of {','.join(SYSTEMS)}")
    if set(front_ends) - set(FRONT_ENDS):
        raise SystemExit(f"unknown front end(s) {sorted(set(front_ends) - set(FRONT_ENDS))}: expected some of "
                         f"{','.join(FRONT_ENDS)}")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="zinf-host-memory-"))
    model = work / "model"
    config = make_pretrained.llama_config("tiny", num_hidden_layers=a.layers, hidden_size=a.hidden,
                                          intermediate_size=a.intermediate, num_attention_heads=8,
                                          num_key_value_heads=8, vocab_size=a.vocab, tie_word_embeddings=False)
    import torch

    summary = make_pretrained.write_pretrained(config, model, dtype=torch.float32, overwrite=True, progress=False)
    meta = {"model": f"Llama {summary.num_parameters / 1e6:.1f}M (L{a.layers}, hidden {a.hidden})",
            "model_bytes": summary.tensor_bytes, "steps": a.steps, "pool_mib": a.pool_mib, "batch": a.batch,
            "machine": machine.describe("cpu", 1024 if a.smoke else 4096, None)}
    rows = [row(s, run(s, model, work, a.steps, a.pool_mib * MIB, a.batch, front), summary.tensor_bytes, front)
            for front in front_ends for s in systems]
    print(render(meta, rows))


if __name__ == "__main__":
    main()
