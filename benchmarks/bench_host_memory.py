"""Host memory of an unchanged transformers ``Trainer`` full fine-tune, per rank, against the model's size and the
engine's own accounting: DDP (``accelerate launch``) beside zinf with everything on NVMe (``zinf launch``), zinf
without its heap trimming during the step (``trim_heap_bytes: 0``), and zinf with glibc told to return freed memory at
once instead (``MALLOC_MMAP_THRESHOLD_``).

    python benchmarks/bench_host_memory.py [--layers 24 --hidden 512 --intermediate 1376 --vocab 8000]
        [--steps 6] [--batch 2] [--pool-mib 64] [--systems ddp,zinf-nvme,zinf-nvme-untrimmed,zinf-nvme-mmap] [--work-dir DIR]
    python benchmarks/bench_host_memory.py --smoke            # a tiny model, 2 steps (CI)

The script (harness/trainer_memory_script.py) calls ``from_pretrained`` on an fp32 Llama checkpoint written by
make_pretrained.py, builds ``Trainer`` and trains (2 ranks, batch 2 x 32 tokens per rank, clipping on); every rank
samples its RSS every 5 ms from just before ``from_pretrained``. Columns, in MiB of growth over that base: after
loading, after ``Trainer(...)`` (it moves the model to ``args.device``), the sampled peak and the kernel's
high-water mark over the whole run, and RSS after the last step beside the engine's own host bytes then
(``engine.resident_bytes()``: the pinned pool and anything gathered), and the most the engine held during a step
(``StepReport.peak_host_bytes``, activations not counted); the worst rank of each. ``step s``: the median
wall time of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
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
ACCELERATE_DDP = HERE.parent / "examples" / "accelerate" / "accelerate_cpu.yaml"
SYSTEMS = ("ddp", "zinf-nvme", "zinf-nvme-untrimmed", "zinf-nvme-mmap")
LABELS = {"ddp": "DDP (accelerate launch)", "zinf-nvme": "zinf, everything on NVMe (zinf launch)",
          "zinf-nvme-untrimmed": "zinf, everything on NVMe, `trim_heap_bytes: 0`",
          "zinf-nvme-mmap": "zinf, everything on NVMe, `trim_heap_bytes: 0`, MALLOC_MMAP_THRESHOLD_=65536"}
MIB = 2**20


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
""" + ("" if trim else "  trim_heap_bytes: 0\n"))
    return path


def run(system: str, model: Path, work: Path, steps: int, pool_bytes: int, batch: int = 2) -> list[dict]:
    out = work / system / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("ZINF_CONFIG", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})
    args = [str(SCRIPT), str(model), str(out), "--steps", str(steps), "--batch", str(batch)]
    if system == "ddp":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_DDP), *args]
    else:
        nvme = work / system / "nvme"
        nvme.mkdir(exist_ok=True)
        config = _zinf_config(work / system / "zinf.yaml", nvme, pool_bytes, trim=system == "zinf-nvme")
        cmd = [sys.executable, "-m", "zinf.cli", "launch", "--config", str(config), *args]
        if system == "zinf-nvme-mmap":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{system} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def row(system: str, ranks: list[dict], model_bytes: int) -> dict:
    def at(r: dict, what: str) -> dict:
        return next(m for m in r["marks"] if m["what"] == what)

    steps = [[m for m in r["marks"] if m["what"].startswith("step ")] for r in ranks]
    times = [b["t"] - a["t"] for a, b in zip(steps[0], steps[0][1:])]
    last = [s[-1] for s in steps]
    peak = max(max(m["peak"] for m in r["marks"]) for r in ranks)
    hosts = [m.get("engine_host") for m in last]
    peaks = [m.get("engine_peak_host") for s in steps for m in s]
    return {"system": LABELS[system], "step_s": statistics.median(times) if times else None,
            "loaded": max(at(r, "loaded")["rss"] for r in ranks) / MIB,
            "trainer": max(at(r, "trainer built")["rss"] for r in ranks) / MIB,
            "peak": peak / MIB, "hwm": max(r["hwm"] for r in ranks) / MIB, "peak_x_model": peak / model_bytes,
            "after": max(m["rss"] for m in last) / MIB,
            "engine_host": max(hosts) / MIB if all(h is not None for h in hosts) else None,
            "engine_peak": max(peaks) / MIB if peaks and all(h is not None for h in peaks) else None}


def render(meta: dict, rows: list[dict]) -> str:
    lines = [f"# host memory: {meta['model']}, {meta['model_bytes'] / MIB:.0f} MiB in fp32, 2 ranks, {meta['steps']} "
             f"steps of {meta['batch']} x 32 tokens per rank, pinned pool {meta['pool_mib']} MiB", "", tables.header(meta["machine"]), "",
             "| system | step s | after load | after Trainer() | peak (sampled) | VmHWM | peak / model | after last "
             "step | engine host bytes | engine's peak in a step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        eng = f"{r['engine_host']:.0f}" if r["engine_host"] is not None else "-"
        epk = f"{r['engine_peak']:.0f}" if r["engine_peak"] is not None else "-"
        step = f"{r['step_s']:.2f}" if r["step_s"] is not None else "-"
        lines.append(f"| {r['system']} | {step} | {r['loaded']:.0f} | {r['trainer']:.0f} | {r['peak']:.0f} | "
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
    p.add_argument("--work-dir", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.vocab, a.steps = 2, 128, 256, 1000, 2
    systems = a.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) {sorted(unknown)}: expected some of {','.join(SYSTEMS)}")
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
    rows = [row(s, run(s, model, work, a.steps, a.pool_mib * MIB, a.batch), summary.tensor_bytes) for s in systems]
    print(render(meta, rows))


if __name__ == "__main__":
    main()
