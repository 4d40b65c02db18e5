"""Is NVMe offload hidden behind compute? One rank, a GPT, three ways back to back in one process, in rounds.

    python benchmarks/bench_offload.py [--layers 8 --embd 512 --vocab 8192 --batch 4 --steps 12 --nvme /tmp/zinf-nvme]
                                       [--rounds 3] [--grads cpu] [--max-cpu-bytes 8589934592]

Runs: plain PyTorch (AdamW), zinf with everything in memory, and zinf with parameters, gradients and optimizer
states on NVMe. "I/O alone" is the NVMe step's bytes at the disk bandwidth measured here first (``zinf info --nvme``'s
sequential O_DIRECT write, read, and both at once; the I/O takes the longest of its reads, its writes and all of it
at the mixed speed). The target: NVMe step <= 1.15 x max(in-memory step, I/O alone), one ratio per round: each
round runs every configuration once, so a ratio compares runs seconds apart on a machine whose speed drifts.
"hidden" is the share of the I/O time that did not add to the step. Step times are medians over the steps after
two of warm-up; the first table's, medians over the rounds. Columns: "gather" is the training thread's time in
gathers (with NVMe: waiting for a shard's read or its background update), "optim" the time in ``engine.step()``,
"nvme rd/wr" the training thread's own I/O waits, "bg rd/wr" the background optimizer step's (hidden
unless a gather waits for it). ``--checksums both`` adds the NVMe row with the CRC32C of offloaded records
turned off (an internal switch, for this measurement only) and prints what the checksums cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zinf  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from zinf import native  # noqa: E402
from zinf.offload.disk_speed import DiskSpeed, measure_path  # noqa: E402


_COLUMNS = ("compute", "all_gather", "optimizer", "nvme_read", "nvme_write", "background_nvme_read", "background_nvme_write")


def run(cfg: GPTConfig, args: argparse.Namespace, zcfg: dict | None, checksums: bool = True) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict(zcfg) if zcfg is not None else None
    if config is None:
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        with zinf.Init(config):
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = zinf.initialize(model, opt, config)
        if engine.placement.swap is not None:
            engine.placement.swap.checksums = checksums  # off only to measure what the CRC32C costs
    times, reports = [], []
    for step in range(args.steps):
        idx, tgt = synthetic_batch(cfg, args.batch, step)
        t = time.perf_counter()
        if config is None:
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            reports.append(engine.report())
        times.append(time.perf_counter() - t)
    out = {"step": statistics.median(times[2:]), "loss": loss.item()}
    if reports:
        keep = reports[2:]
        for key in _COLUMNS:
            out[key] = statistics.median(r.seconds.get(key, 0.0) for r in keep)
        out["checksum"] = statistics.median(r.seconds.get("checksum", 0.0) for r in keep)
        out["background_checksum"] = statistics.median(r.seconds.get("background_checksum", 0.0) for r in keep)
        out["io_bytes"] = statistics.median(r.counts.get("nvme_read_bytes", 0) + r.counts.get("nvme_written_bytes", 0) for r in keep)
        out["read_bytes"] = statistics.median(r.counts.get("nvme_read_bytes", 0) for r in keep)
        out["write_bytes"] = statistics.median(r.counts.get("nvme_written_bytes", 0) for r in keep)
        engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of all the runs, back to back; each round gives one ratio (default 3)")
    p.add_argument("--nvme", default="/tmp/zinf-nvme")
    p.add_argument("--grads", default="nvme", choices=["auto", "cpu", "nvme"],
                   help="offload.grads (auto: in host memory where they fit, else on NVMe)")
    p.add_argument("--max-cpu-bytes", type=int, default=0,
                   help="offload.max_cpu_bytes of the NVMe row: a host budget, which has the engine trim its heap "
                        "during the step (default 0: none; at this size the heap is then left to glibc)")
    p.add_argument("--adam-threads", type=int, default=0, help="threads of the C++ CPU-Adam (0: all cores)")
    p.add_argument("--checksums", default="on", choices=["on", "both"],
                   help="both: also run the NVMe row with the CRC32C of offloaded records off, to measure its cost")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    os.makedirs(args.nvme, exist_ok=True)
    cfg = GPTConfig(vocab=args.vocab, block=128, n_embd=args.embd, n_head=8, n_layer=args.layers)
    numel = sum(p.numel() for p in dict.fromkeys(GPT(cfg).parameters()))
    print(f"GPT {numel / 1e6:.1f}M parameters, batch {args.batch}x{cfg.block}, {torch.get_num_threads()} threads, "
          f"native {native.info().simd_level}/{native.info().io_backend}")
    wbw, rbw, mbw, _ = measure_path(args.nvme, 1 << 30)  # what zinf info --nvme measures
    disk = DiskSpeed(rbw * 1e9, wbw * 1e9, mbw * 1e9)
    print(f"disk ({args.nvme}): write {wbw:.2f} GB/s, read {rbw:.2f} GB/s, both at once {mbw:.2f} GB/s")
    if args.adam_threads:
        native.set_num_threads(args.adam_threads)
    nvme_cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [args.nvme],
                            "pinned_pool_bytes": 512 << 20, "sub_group_numel": 8 << 20, "grads": args.grads,
                            "max_cpu_bytes": args.max_cpu_bytes}}
    runs = [("plain PyTorch", None, True), ("zinf in memory", {}, True), (f"zinf NVMe (grads {args.grads})", nvme_cfg, True)]
    if args.checksums == "both":
        runs.append(("zinf NVMe, no checksums", nvme_cfg, False))
    # every round runs each configuration once, back to back: the ratios pair runs seconds apart, so a machine whose
    # speed drifts between rounds (a shared host) moves both sides of a ratio alike
    rounds: list[dict[str, dict]] = []
    for _ in range(args.rounds):
        rounds.append({name: run(cfg, args, zcfg, checksums=crc) for name, zcfg, crc in runs})
    print()
    print(f"{'run':<28}{'step s':>9}{'compute':>9}{'gather':>9}{'optim':>9}{'nvme rd':>9}{'nvme wr':>9}{'bg rd':>9}{'bg wr':>9}"
          f"{'I/O GB':>8}")
    for name, _, _ in runs:  # medians over the rounds
        r = {k: statistics.median(res[name].get(k, 0.0 if k == "io_bytes" else float("nan")) for res in rounds)
             for k in ("step", "io_bytes", *_COLUMNS)}
        cells = "".join(f"{r[k]:>9.3f}" for k in _COLUMNS)
        print(f"{name:<28}{r['step']:>9.3f}{cells}{r['io_bytes'] / 1e9:>8.2f}")
    mem_name, nvme_name = runs[1][0], runs[2][0]
    print()
    print(f"{'round':<7}{'in memory':>10}{'NVMe':>8}{'I/O alone':>11}{'NVMe / bound':>14}{'NVMe / in memory':>18}"
          f"{'I/O hidden':>12}{'CRC32C s':>10}")
    ratios = []
    for i, results in enumerate(rounds):
        mem, nvme = results[mem_name], results[nvme_name]
        io_alone = disk.floor_s(nvme["read_bytes"], nvme["write_bytes"])  # as the step report's nvme_floor
        ratio = nvme["step"] / max(mem["step"], io_alone)
        hidden = 1.0 - max(0.0, nvme["step"] - mem["step"]) / io_alone if io_alone else 1.0
        crc = nvme["checksum"] + nvme["background_checksum"]
        ratios.append(ratio)
        print(f"{i + 1:<7}{mem['step']:>10.3f}{nvme['step']:>8.3f}{io_alone:>11.3f}{ratio:>13.2f}x"
              f"{nvme['step'] / mem['step']:>17.2f}x{100 * hidden:>11.0f}%{crc:>10.3f}")
    print()
    print(f"NVMe step / max(in-memory step, I/O alone): median {statistics.median(ratios):.2f}x over {len(ratios)} "
          f"round(s), {min(ratios):.2f}-{max(ratios):.2f}x (target <= 1.15x). CRC32C: seconds per step of the "
          "checksums on passes of their own, on the training thread and in the background step (those the Adam pass "
          "and the copies into pool buffers take are not timed apart).")
    if args.checksums == "both":
        costs = [r[nvme_name]["step"] / r[runs[3][0]]["step"] for r in rounds]
        print(f"NVMe step with checksums / without: median {statistics.median(costs):.3f}x; by round "
              f"{', '.join(f'{c:.3f}x' for c in costs)} (goal: under 1.02x)")


if __name__ == "__main__":
    main()
