"""Step time as the ranks go 1, 2, 4 at the same global batch, for each distributed system, with plain PyTorch
(one process) as the reference.

    python benchmarks/bench_ranks_curve.py --out docs/benchmarks/ranks_curve          # the published curve
    python benchmarks/bench_ranks_curve.py --plot docs/benchmarks/ranks_curve/ranks_curve.json   # redraw only
    python benchmarks/bench_ranks_curve.py --smoke --out /tmp/ranks                   # seconds (CI)

Each (system, rank count) is one run in fresh processes under the memory watchdog (harness/watchdog.py); the
``--threads`` CPU threads are split over the ranks (on a CPU machine more ranks share the same cores: the
curve shows what partitioning costs and saves there, not a speed-up from added hardware). Runs alternate
over ``--passes`` passes (reversed every other pass) and the table keeps each one's best median step.
Writes ranks_curve.json / .csv, table.md and ranks_curve.png.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cli, plots, tables  # noqa: E402

STEM = "ranks_curve"


def render(meta: dict, rows: list[dict], out: str) -> str:
    best = tables.best_of(rows)
    text = "\n\n".join([
        f"# ranks curve: {meta['model']}, global batch {meta['global_batch']}, ranks {meta['ranks_list']}, "
        f"{meta['steps']} steps ({meta['warmup']} warm-up), best of {meta['passes']} pass(es)",
        tables.header(meta),
        tables.curve_table(best, "ranks", "ranks")])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    plots.ranks_curve(best, os.path.join(out, STEM + ".png"),
                      f"{meta['model']}, global batch {meta['global_batch']}, fp32, {meta['cpu'][:50]}")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt:medium", help="FAMILY:SIZE (harness/models.py)")
    p.add_argument("--ranks-list", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--passes", type=int, default=2)
    cli.add_common(p, out="bench_out/ranks_curve", steps=8, warmup=2, global_batch=8)
    cli.smoke_defaults(p, model="gpt:tiny", ranks_list=[1, 2], steps=2, warmup=1, passes=1, global_batch=2,
                       systems="zinf-mem,ds-cpu")
    args = p.parse_args()
    if cli.redraw(args, render):
        return
    system_names, meta = cli.start(args, model=args.model, ranks_list=args.ranks_list, passes=args.passes)
    runs = [(s, 1) for s in system_names if s == "plain"] + [(s, n) for n in args.ranks_list for s in system_names
                                                             if s != "plain"]
    rows: list[dict] = []
    for n in range(args.passes):
        for system, ranks in (runs if n % 2 == 0 else runs[::-1]):
            row = cli.run(args, meta, system, args.model, ranks)
            row["pass"] = n + 1
            rows.append(row)
            print(f"pass {n + 1} ranks {ranks} {row['label']:<44} {cli.step_text(row)}", flush=True)
            tables.write_raw(args.out, STEM, meta, rows)
    print()
    print(render(meta, rows, args.out))


if __name__ == "__main__":
    main()
