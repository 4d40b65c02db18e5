"""The options every comparison script takes, and what they turn into (limits, the machine's description)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Callable

from harness import systems, tables
from harness.watchdog import Limits

DEFAULT_DS_PYTHON = "/work/dsvenv/bin/python"


def add_common(p: argparse.ArgumentParser, *, out: str, steps: int, warmup: int, global_batch: int) -> None:
    p.add_argument("--systems", default=",".join(systems.SYSTEMS),
                   help=f"comma-separated subset of {','.join(systems.SYSTEMS)}")
    p.add_argument("--global-batch", type=int, default=global_batch, help="sequences per step, split over the ranks")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out of the median")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per run, split over its ranks")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--out", default=out, help="where the JSON, CSV, markdown tables and PNG plots go")
    p.add_argument("--work-dir", help="NVMe swap directories and the runs' logs (default OUT/work; put it on the "
                                      "disk you mean to measure)")
    p.add_argument("--ds-python", default=os.environ.get("ZINF_BENCH_DS_PYTHON", DEFAULT_DS_PYTHON),
                   help="the DeepSpeed venv's python (DeepSpeed is never a zinf dependency); absent: DeepSpeed rows "
                        "say 'skipped'")
    p.add_argument("--zinf-python", action="append", default=[], metavar="NAME=PYTHON",
                   help="another build of zinf to compare, by the interpreter that imports it (a venv with an earlier "
                        "commit installed); its runs are the zinf systems named with @NAME (zinf-mem@NAME), "
                        "alternating with this build's in one run")
    p.add_argument("--limit-gib", type=float, default=21.0, help="watchdog: kill a run whose ranks' RSS passes this")
    p.add_argument("--min-avail-gib", type=float, default=1.0, help="watchdog: kill a run when MemAvailable drops under")
    p.add_argument("--cap-min", type=float, default=25.0, help="watchdog: wall-clock cap per run, minutes")
    p.add_argument("--peak-n", type=int, default=4096, help="matrix size of the fp32 torch.mm that measures the peak")
    p.add_argument("--smoke", action="store_true", help="seconds: a tiny model, 2 steps (CI)")
    p.add_argument("--plot", metavar="JSON", help="only redraw the plots and tables from this raw JSON, run nothing")


def zinf_pythons(args: argparse.Namespace) -> dict[str, str]:
    """``--zinf-python NAME=PYTHON`` options as {NAME: PYTHON}."""
    found = {}
    for item in args.zinf_python:
        name, sep, python = item.partition("=")
        if not sep or not name or not os.path.exists(python):
            raise SystemExit(f"--zinf-python {item!r}: expected NAME=PYTHON with an existing interpreter")
        found[name] = python
    return found


def system_list(args: argparse.Namespace) -> list[str]:
    names = [s for s in args.systems.split(",") if s]
    builds = zinf_pythons(args)

    def known(name: str) -> bool:
        rest, _, build = name.partition("@")
        system, _, variant = rest.partition("+")
        info = systems.SYSTEMS.get(system)
        if info is None or variant not in ("", "compile") or (variant and info.kind == "deepspeed"):
            return False
        return not build or (info.kind == "zinf" and build in builds)

    unknown = [s for s in names if not known(s)]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {','.join(systems.SYSTEMS)}; SYSTEM+compile "
                         f"compiles each block (not DeepSpeed); a zinf system may name another build: SYSTEM@NAME, with "
                         f"--zinf-python NAME=PYTHON")
    return names


def base_system(name: str) -> str:
    """``zinf-mem`` of ``zinf-mem+compile@base``."""
    return name.partition("@")[0].partition("+")[0]


def limits(args: argparse.Namespace) -> Limits:
    return Limits(rss_gib=args.limit_gib, min_avail_gib=args.min_avail_gib, cap_s=args.cap_min * 60)


def prepare(args: argparse.Namespace) -> dict:
    """Make the output and work directories; describe the machine and measure its matmul peak."""
    import torch

    from harness.machine import describe

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.work_dir = args.work_dir or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    meta = describe(args.device, args.peak_n, args.ds_python)
    meta["disk"] = f"{args.work_dir}: {shutil.disk_usage(args.work_dir).free / 2**30:.0f} GiB free"
    return meta


def smoke_defaults(p: argparse.ArgumentParser, **defaults: object) -> None:
    """Under ``--smoke``, these become the defaults (a tiny model, 2 steps, a small peak matmul); options given
    on the command line still win."""
    if "--smoke" in sys.argv[1:]:
        p.set_defaults(peak_n=512, **defaults)


def redraw(args: argparse.Namespace, render: Callable[[dict, list[dict], str], str]) -> bool:
    """With ``--plot JSON``: reprint the tables and redraw the plots from the raw JSON (nothing runs, no torch) and
    return True."""
    if not args.plot:
        return False
    meta, rows = tables.read_raw(args.plot)
    print(render(meta, rows, os.path.dirname(os.path.abspath(args.plot))))
    return True


def start(args: argparse.Namespace, **fields: object) -> tuple[list[str], dict]:
    """Before a script's runs: the systems chosen, the machine described (``prepare``), the run's settings and
    ``fields`` in its meta, the table header printed."""
    names = system_list(args)
    meta = prepare(args)
    meta.update(global_batch=args.global_batch, steps=args.steps, warmup=args.warmup, systems=names,
                smoke=args.smoke, **fields)
    print(tables.header(meta), flush=True)
    return names, meta


def run(args: argparse.Namespace, meta: dict, system: str, model: str, ranks: int) -> dict:
    """One system on one model at ``ranks`` ranks, with the script's settings (harness/launch.py)."""
    from harness.launch import run_system  # torch and the models: not needed to redraw

    return run_system(system, model, ranks=ranks, global_batch=args.global_batch, steps=args.steps,
                      warmup=args.warmup, threads=args.threads, limits=limits(args), work_dir=args.work_dir,
                      ds_python=args.ds_python, device=args.device, peak_flops=meta["peak_flops"],
                      zinf_pythons=zinf_pythons(args))


def step_text(row: dict) -> str:
    """A run's step time, or its status and error, for the progress lines."""
    return f"{row['step_s']:.3f} s" if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
