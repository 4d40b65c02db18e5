"""Parameter shards stored in bf16 with fp32 compute (``param_storage: bf16``) against fp32 storage, parameters on
NVMe, one rank, back to back in one process (fp32, bf16, fp32, bf16, ...; medians over the repeats).

    python benchmarks/bench_param_storage.py [--nvme /tmp/zinf-nvme] [--steps 8] [--repeats 2]

Two models whose parameters do not fit the pinned pool, so that parameter shards are read from NVMe every step:
the README's example GPT (3.2M parameters, examples/configs/gpt_small.yaml's shape, 12.8 MB in fp32) with an 8 MiB
pool, and a 50.6M-parameter GPT (16 layers x 512, 202 MB in fp32, six times its 32 MiB pool; the smallest pool
that stages its largest group in fp32). The optimizer states stay on the CPU (C++ CPU-Adam), so the NVMe bytes
are the parameters' alone. Columns: median step time over the steps after two of warm-up, NVMe bytes read and
written per step (the engine's report), the parameter shards' bytes at rest per parameter (the engine's
accounting, 4 KiB record alignment included), and the last step's loss.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from zinf import native  # noqa: E402

MODELS = {  # name: (model shape, pinned pool bytes, optimizer sub-group numel, batch)
    "example GPT": (GPTConfig(vocab=256, block=64, n_embd=256, n_head=8, n_layer=4), 8 << 20, 1 << 18, 8),
    "GPT 50M": (GPTConfig(vocab=256, block=128, n_embd=512, n_head=8, n_layer=16), 32 << 20, 1 << 20, 4),
}


def run(cfg: GPTConfig, pool_bytes: int, sub_group_numel: int, batch: int, storage: str, nvme: str, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"precision": "fp32", "param_storage": storage, "offload": {
        "params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": pool_bytes,
        "sub_group_numel": sub_group_numel}})
    with zinf.Init(config):
        model = GPT(cfg)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    numel = sum(g.numel for g in engine.groups)
    times, reads, writes = [], [], []
    for step in range(steps):
        idx, tgt = synthetic_batch(cfg, batch, step)
        t = time.perf_counter()
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        report = engine.report()
        reads.append(report.counts.get("nvme_read_bytes", 0))
        writes.append(report.counts.get("nvme_written_bytes", 0))
    at_rest = engine.resident_bytes().get("nvme", {}).get("param_shards", 0) / numel
    engine.close()
    return {"step": statistics.median(times[2:]), "read": statistics.median(reads[2:]),
            "written": statistics.median(writes[2:]), "at_rest": at_rest, "loss": loss.item(), "numel": numel}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme", default=None, help="directory for the swap files (default: a temporary one in /tmp)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    nvme = args.nvme or tempfile.mkdtemp(prefix="zinf_bench_")
    os.makedirs(nvme, exist_ok=True)
    info = native.info()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU-Adam {info.simd_level}, "
          f"I/O {info.io_backend}; swap files in {nvme}")
    print(f"{'model':<14}{'storage':>9}{'params':>9}{'pool':>7}{'step s':>9}{'read MB':>9}{'written MB':>11}"
          f"{'B/param':>9}{'loss':>9}")
    try:
        for name, (cfg, pool, sub_group, batch) in MODELS.items():
            results: dict[str, list[dict[str, float]]] = {"fp32": [], "bf16": []}
            for _ in range(args.repeats):
                for storage, key in (("precision", "fp32"), ("bf16", "bf16")):
                    results[key].append(run(cfg, pool, sub_group, batch, storage, nvme, args.steps))
            med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
            for key, r in med.items():
                print(f"{name:<14}{key:>9}{r['numel'] / 1e6:>8.1f}M{pool >> 20:>5}MiB{r['step']:>9.3f}"
                      f"{r['read'] / 1e6:>9.1f}{r['written'] / 1e6:>11.1f}{r['at_rest']:>9.2f}{r['loss']:>9.4f}")
            a, b = med["fp32"], med["bf16"]
            print(f"{name:<14}{'ratio':>9}{'':>16}{a['step'] / b['step']:>8.2f}x{a['read'] / max(b['read'], 1):>8.2f}x"
                  f"{a['written'] / max(b['written'], 1):>10.2f}x{a['at_rest'] / b['at_rest']:>8.2f}x  (fp32 / bf16)")
    finally:
        if args.nvme is None:
            shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    main()
