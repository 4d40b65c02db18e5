"""Step time and peak memory per rank as the model grows, for each system, until it no longer trains.

    python benchmarks/bench_size_curve.py --out docs/benchmarks/size_curve            # the published curve
    python benchmarks/bench_size_curve.py --plot docs/benchmarks/size_curve/size_curve.json   # redraw only
    python benchmarks/bench_size_curve.py --smoke --out /tmp/size                      # seconds (CI)

The model is ``--model`` (a FAMILY:SIZE of harness/models.py; default gpt:xl, n_embd 2048, vocab 32768) at
each depth of ``--layers`` (1 layer is ~0.12B parameters, 64 layers ~3.3B). At each size every system still
in the race runs once in fresh processes (``--ranks`` of them; plain PyTorch one) under the memory watchdog
of harness/watchdog.py, which kills a run before the kernel's OOM killer would (``--limit-gib`` over all
ranks, ``--min-avail-gib``, disk free, ``--cap-min``); a system that fails or is killed at one size is not
run at larger ones, and its row says where and why. Writes size_curve.json / .csv, table.md and
size_curve.png (step time and peak RSS per rank against parameters; an x where a system stopped).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cli, plots, tables  # noqa: E402

STEM = "size_curve"


def render(meta: dict, rows: list[dict], out: str) -> str:
    text = "\n\n".join([
        f"# size curve: {meta['model']} at n_layer {', '.join(map(str, meta['layers']))}; global batch "
        f"{meta['global_batch']}, {meta['ranks']} rank(s) for the distributed systems, {meta['steps']} steps "
        f"({meta['warmup']} warm-up); watchdog {meta['limit_gib']} GiB over all ranks",
        tables.header(meta),
        tables.curve_table(rows, "n_layer", "n_layer")])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    plots.size_curve(rows, os.path.join(out, STEM + ".png"),
                     f"{meta['model']} growing in depth; global batch {meta['global_batch']}, {meta['ranks']} rank(s), "
                     f"fp32, {meta['cpu'][:50]}", meta["limit_gib"], meta["ranks"])
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt:xl", help="FAMILY:SIZE whose depth grows (harness/models.py)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    p.add_argument("--ranks", type=int, default=2, help="processes of every system but plain PyTorch")
    cli.add_common(p, out="bench_out/size_curve", steps=3, warmup=1, global_batch=2)
    cli.smoke_defaults(p, model="gpt:tiny", layers=[1, 2], steps=2, warmup=1, ranks=1, systems="zinf-cpu,ds-nvme")
    args = p.parse_args()
    if cli.redraw(args, render):
        return
    system_names, meta = cli.start(args, model=args.model, layers=args.layers, ranks=args.ranks,
                                   limit_gib=args.limit_gib)
    rows: list[dict] = []
    racing = list(system_names)
    for layers in args.layers:
        for system in list(racing):
            row = cli.run(args, meta, system, f"{args.model}:L{layers}", 1 if system == "plain" else args.ranks)
            rows.append(row)
            if row["status"] != "ok":
                racing.remove(system)
            print(f"L={layers:<3} {row['numel'] / 1e6:9.1f}M {row['label']:<44} {cli.step_text(row)}  "
                  f"peak RSS/rank {row.get('peak_rss_per_rank_gib', 0):.2f} GiB", flush=True)
            tables.write_raw(args.out, STEM, meta, rows)
        if not racing:
            break
    print()
    print(render(meta, rows, args.out))


if __name__ == "__main__":
    main()
