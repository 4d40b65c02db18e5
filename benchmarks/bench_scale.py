"""Train a GPT whose fp32 model states are larger than this machine's RAM: parameters, gradients
and optimizer states on NVMe, one rank, a few steps. Prints where time and memory go.

    THP_MEM_ALLOC_ENABLE=1 python benchmarks/bench_scale.py --nvme /work/zinf-nvme   # ~3.27B parameters, ~52 GB
    python benchmarks/bench_scale.py --layers 4 --embd 512 --nvme /tmp/n  # a quick check of the script

``THP_MEM_ALLOC_ENABLE=1`` (a PyTorch setting) backs large CPU tensors with huge pages, which makes
the page faults of freshly gathered parameters and new gradients much cheaper; it is optional.
The model is built under ``zinf.Init`` (each layer is partitioned as soon as it exists), the
initial state is written to the swap files and freed, and then each step reads parameter shards
ahead of use and runs the CPU-Adam sub-group pipeline over NVMe in the background. Peak RSS is the
process high-water mark (``ru_maxrss``); a sampler thread also records the peak of each phase.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

GiB = 2**30


class RssSampler:
    """Peak resident set size of this process, per phase (sampled every 50 ms) and overall."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.rss())

    def phase(self) -> int:
        """The peak since the last call; starts the next phase."""
        peak, self.peak = max(self.peak, self.rss()), self.rss()
        return peak

    @staticmethod
    def high_water() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def disk_bytes(paths: list[str]) -> int:
    total = 0
    for d in paths:
        for name in os.listdir(d):
            if name.startswith("zinf-") and name.endswith(".swap"):
                total += os.stat(os.path.join(d, name)).st_blocks * 512
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=41)
    p.add_argument("--embd", type=int, default=2560)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme", nargs="+", required=True, help="one or more directories for the swap files")
    p.add_argument("--pool-mib", type=int, default=4096, help="offload.pinned_pool_bytes in MiB")
    p.add_argument("--sub-group", type=int, default=8 << 20, help="offload.sub_group_numel")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for d in args.nvme:
        os.makedirs(d, exist_ok=True)
    cfg = GPTConfig(vocab=args.vocab, block=args.block, n_embd=args.embd, n_head=max(1, args.embd // 128),
                    n_layer=args.layers)
    numel = args.layers * (12 * args.embd**2 + 13 * args.embd) + (args.vocab + args.block + 2) * args.embd
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"GPT {numel / 1e9:.3f}B parameters ({args.layers} layers, n_embd {args.embd}, vocab {args.vocab}); "
          f"fp32 model states {16 * numel / 1e9:.1f} GB = {16 * numel / ram:.2f}x this machine's RAM "
          f"({ram / GiB:.1f} GiB); batch {args.batch}x{args.block}; {torch.get_num_threads()} threads", flush=True)
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "nvme", "optimizer": "nvme", "grads": "nvme", "nvme_paths": args.nvme,
        "pinned_pool_bytes": args.pool_mib << 20, "sub_group_numel": args.sub_group}})
    sampler = RssSampler()
    rows: list[tuple[str, float, int]] = []

    t = time.perf_counter()
    torch.manual_seed(0)
    with zinf.Init(config):
        model = GPT(cfg)
    rows.append(("build under zinf.Init", time.perf_counter() - t, sampler.phase()))
    t = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = zinf.initialize(model, opt, config)
    rows.append(("write initial state to NVMe", time.perf_counter() - t, sampler.phase()))
    on_disk = disk_bytes(args.nvme)
    print(f"swap files: {on_disk / 1e9:.1f} GB on {', '.join(args.nvme)}", flush=True)

    reports = []
    for step in range(args.steps):
        idx, tgt = synthetic_batch(cfg, args.batch, step)
        t = time.perf_counter()
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t
        rows.append((f"step {step + 1} (loss {loss.item():.4f})", seconds, sampler.phase()))
        reports.append(engine.report())
        logging.info("step %d: %.1f s, loss %.4f, %s", step + 1, seconds, loss.item(), reports[-1].summary())
    t = time.perf_counter()
    engine.synchronize()  # the last background step, apart: each step before waited for its predecessor's
    rows.append(("last background step", time.perf_counter() - t, sampler.phase()))
    engine.close()

    print()
    print(f"{'phase':<34}{'seconds':>10}{'peak RSS GiB':>14}")
    for name, seconds, peak in rows:
        print(f"{name:<34}{seconds:>10.1f}{peak / GiB:>14.2f}")
    print(f"{'whole run (ru_maxrss)':<34}{'':>10}{RssSampler.high_water() / GiB:>14.2f}")
    last = reports[-1]
    print()
    print("last step breakdown (s): " + ", ".join(f"{k} {last.seconds.get(k, 0.0):.1f}" for k in
          ("forward", "backward", "compute", "all_gather", "optimizer", "nvme_read", "nvme_write",
           "background_nvme_read", "background_nvme_write", "step")))
    print(f"last step NVMe traffic: read {last.counts.get('nvme_read_bytes', 0) / 1e9:.1f} GB, "
          f"written {last.counts.get('nvme_written_bytes', 0) / 1e9:.1f} GB")
    print("bytes per tier at the end of the last step (GiB): " + "; ".join(
        f"{tier}: " + ", ".join(f"{kind} {n / GiB:.2f}" for kind, n in sorted(kinds.items()))
        for tier, kinds in sorted(last.bytes.items())))
    print(f"swap files on disk: {on_disk / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
