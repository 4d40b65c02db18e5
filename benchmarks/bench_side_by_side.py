"""zinf side by side with plain PyTorch, DDP, FSDP2 (with and without CPUOffloadPolicy) and DeepSpeed ZeRO-3
(CPU and NVMe offload), on GPT-style models, same global batch and hyper-parameters, fp32.

    python benchmarks/bench_side_by_side.py --out docs/benchmarks/side_by_side_default  # the four default models
    python benchmarks/bench_side_by_side.py --plot docs/benchmarks/side_by_side/side_by_side.json   # redraw only
    python benchmarks/bench_side_by_side.py --smoke --out /tmp/sbs                        # seconds (CI)

Every (model, system) is one run in fresh processes (``--ranks`` of them for DDP, FSDP2, DeepSpeed and zinf;
one for plain PyTorch), under the memory watchdog of harness/watchdog.py. The runs go back to back and
alternate: pass 1 runs every system once, pass 2 again in the reverse order, and so on for ``--passes``;
each run's step time is the median of its steps after ``--warmup``; the table keeps each system's best pass.
Systems and models: harness/systems.py, harness/models.py. Per run: step time, tokens/s, achieved FLOP/s
(6 per matmul weight + attention, per token) and their share of this machine's fp32 matmul peak (measured
first with a large torch.mm), peak host RSS per rank, CUDA max_memory_allocated (on GPU), peak bytes in the
NVMe directory, and zinf's StepReport breakdown. Writes side_by_side.json / .csv (every pass), table.md and
side_by_side.png into ``--out``. DeepSpeed runs in its own venv (``--ds-python``); without it its rows say
"skipped"; where it fails, its error is in its row.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cli, plots, tables  # noqa: E402

STEM = "side_by_side"


def render(meta: dict, rows: list[dict], out: str) -> str:
    best = tables.best_of(rows)
    text = "\n\n".join([
        f"# side by side: global batch {meta['global_batch']} sequences, {meta['ranks']} rank(s) for the distributed "
        f"systems, {meta['steps']} steps ({meta['warmup']} warm-up), best of {meta['passes']} pass(es)",
        tables.header(meta),
        "step time ratios: this system's step / the baseline's on the same model (below 1.00x: faster)",
        tables.ratio_table(best),
        "zinf time breakdown (ms, median StepReport of the measured steps):",
        tables.breakdown_table(best)])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    plots.side_by_side(best, os.path.join(out, STEM + ".png"),
                       f"global batch {meta['global_batch']}, {meta['ranks']} rank(s), fp32, {meta['cpu'][:60]}")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt:small,gpt:medium,gpt2:medium,llama:medium",
                   help="comma-separated FAMILY:SIZE (harness/models.py)")
    p.add_argument("--ranks", type=int, default=2, help="processes of every system but plain PyTorch")
    p.add_argument("--passes", type=int, default=3)
    cli.add_common(p, out="bench_out/side_by_side", steps=10, warmup=3, global_batch=8)
    # --smoke: seconds, one rank each (bench_ranks_curve.py --smoke runs two); any option given still wins
    cli.smoke_defaults(p, models="gpt:tiny", steps=2, warmup=1, passes=1, global_batch=2, ranks=1,
                       systems="plain,ddp,fsdp2-offload,zinf-nvme,ds-cpu,ds-nvme")
    args = p.parse_args()
    if cli.redraw(args, render):
        return
    system_names, meta = cli.start(args, ranks=args.ranks, passes=args.passes, models=args.models.split(","))
    rows: list[dict] = []
    for n in range(args.passes):
        order = system_names if n % 2 == 0 else system_names[::-1]
        for model in args.models.split(","):
            for system in order:
                row = cli.run(args, meta, system, model, 1 if cli.base_system(system) == "plain" else args.ranks)
                row["pass"] = n + 1
                rows.append(row)
                print(f"pass {n + 1} {model:<14} {row['label']:<44} {cli.step_text(row)}", flush=True)
                tables.write_raw(args.out, STEM, meta, rows)  # after every run: a killed benchmark keeps its rows
    print()
    print(render(meta, rows, args.out))


if __name__ == "__main__":
    main()
