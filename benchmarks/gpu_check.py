"""zinf on a GPU in one command: the GPU tests, the host overhead, a side by side on a ~1B GPT in bf16, the NVMe
drive's bandwidth and two ranks on one GPU, into one results folder (docs/gpu.md says when and how to run it).

    pip install --no-build-isolation --no-deps -e . && python benchmarks/gpu_check.py --out docs/gpu
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check      # the same steps on the CPU, tiny models (CI)

Writes ``OUT/<date>-<gpu>/summary.md`` (the machine, the goals met or missed, each part's status and figures),
``results.json`` (everything, raw) and ``pytest.log``, after every part, so a call cut short keeps what ran. Parts
(harness/gpu_parts.py), in the order they run, each under a time limit (and all under ``--budget-s``):

1. ``python -m pytest tests/gpu``: streams and fences, tiling, parity with plain PyTorch, bf16 with the optimizer
   on CPU and on NVMe;
4. ``zinf info --nvme`` on the work directory's disk: the bandwidth the NVMe step is judged against;
5. two ranks on one device with gloo and the device's tensors, fp32, against plain PyTorch's losses;
2. benchmarks/bench_host_overhead.py when the tree has it, and a torch.profiler trace of zinf steps summarised;
3. the side by side (harness/systems.py) on ``gpt:xl:L18`` (0.97B) in bf16: plain PyTorch, FSDP2, zinf in memory,
   zinf and FSDP2 with every block compiled, FSDP2 CPUOffloadPolicy, optimizer on CPU, parameters and optimizer on
   CPU, on NVMe; tokens/s and MFU against the bf16 matmul peak measured first, device and host peak memory.

The goals (harness/gpu_report.py) are judged on those figures. Nothing is installed; the device machine's torch is
used as it is. ``--smoke`` runs the same parts with tiny models, several tasks at a time (``--jobs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import gpu_parts, gpu_report  # noqa: E402
from harness.gpu_parts import Check, Part  # noqa: E402

MIN_PART_S = 15.0  # a part with less time left than this is skipped


def describe(settings: gpu_parts.Settings, device: str, command: str, budget_s: float, commit: str | None) -> dict:
    import torch

    from harness.machine import describe as machine, gpu_summary

    meta = machine(device, settings.peak_n, None, dtype=torch.bfloat16, inner=10 if device == "cuda" else 1,
                   transformers=False)
    meta["versions"]["zinf_commit"] = commit or meta["versions"].get("zinf_commit") or "unknown (no git checkout)"
    meta.update(gpu_summary() if device == "cuda" else {})
    if device == "cuda":
        torch.cuda.empty_cache()
    meta.update(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), smoke=settings.smoke,
                precision=settings.precision, command=command, budget_s=budget_s)
    return meta


def results_folder(out: str, meta: dict) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", (meta.get("gpu") or "cpu").lower()).strip("-")
    base = os.path.join(out, f"{meta['date']}-{name}" + ("-smoke" if meta["smoke"] else ""))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    os.makedirs(path)
    return path


def write(folder: str, results: dict) -> None:
    """results.json, then summary.md; a failure to judge or render (the check's own bug) is written in their place
    and the raw results are kept."""
    try:
        results["goals"] = gpu_report.goals(results)
    except Exception:  # noqa: BLE001
        results["goals"] = [{"goal": "judging the goals", "target": "", "result": "not measured",
                             "measured": traceback.format_exc().strip().splitlines()[-1], "figures": ""}]
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    try:
        text = gpu_report.markdown(results)
    except Exception:  # noqa: BLE001
        text = f"# zinf GPU check\n\nwriting this summary failed (the figures are in results.json):\n\n" \
               f"```\n{traceback.format_exc()}```\n"
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(text)


def run_parts(check: Check, parts: list[Part], deadline: float, jobs: int, on_done) -> None:
    """Each part's tasks under the part's limit (and the deadline), one after another, in order; with ``jobs`` > 1
    the tasks of all parts share a pool of that many (smoke: timings don't count), each task under its part's
    limit from its own start."""
    limits = check.settings.part_limits_s

    def run_task(part: Part, fn, started: float | None) -> dict:
        now = time.monotonic()
        left = min((started if started is not None else now) + limits[part.key], deadline) - now
        if left < MIN_PART_S:
            raise TimeoutError(f"out of time ({left:.0f} s left)")
        return fn(check, left)

    def finish(part: Part, done: dict, started: float, errors: dict) -> None:
        """The part's record from the tasks that ran; a task that did not (out of time, or the check's own error)
        is named in the note, and makes the part ``timed out`` (or ``failed``)."""
        late = all(isinstance(e, TimeoutError) for e in errors.values())
        try:
            record = part.combine(check, done) if done else {"status": "skipped" if late else "failed", "note": ""}
        except Exception as exc:  # noqa: BLE001 - the check's own bug: keep what ran, go on with the next part
            record = {"status": "failed", "note": f"summarising the part failed: {exc!r}", "done": done,
                      "traceback": traceback.format_exc()}
        if errors:
            if done:
                record["status"] = "timed out" if late else "failed"
            out_of_time = [k for k, e in errors.items() if isinstance(e, TimeoutError)]
            record["note"] = "; ".join([*([f"out of time, not run: {', '.join(out_of_time)}"] if out_of_time else []),
                                        *(f"{k}: {type(e).__name__}: {e}" for k, e in errors.items()
                                          if not isinstance(e, TimeoutError)),
                                        *([record["note"]] if record["note"] else [])])
        record.update(title=part.title, elapsed_s=time.monotonic() - started, limit_s=limits[part.key])
        on_done(part, record)

    if jobs <= 1:
        for part in parts:
            started, done, errors = time.monotonic(), {}, {}
            for name, fn in part.tasks:
                try:
                    done[name] = run_task(part, fn, started)
                except Exception as exc:  # noqa: BLE001 - recorded as the part's failure, the check goes on
                    errors[name] = exc
            finish(part, done, started, errors)
        return
    started = time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        futures = [(part, [(name, pool.submit(run_task, part, fn, None)) for name, fn in part.tasks])
                   for part in parts]
        for part, named in futures:
            done, errors = {}, {}
            for name, fut in named:
                try:
                    done[name] = fut.result()
                except Exception as exc:  # noqa: BLE001
                    errors[name] = exc
            finish(part, done, started, errors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/gpu", help="the results folder is made in here")
    p.add_argument("--smoke", action="store_true", help="the same parts on the CPU with tiny models, in seconds")
    p.add_argument("--budget-s", type=float, help="every part ends by then (default 390 on a GPU, 280 smoke)")
    keys = ",".join(pt.key for pt in gpu_parts.parts(gpu_parts.GPU))
    p.add_argument("--parts", help=f"a comma-separated subset of {keys}")
    p.add_argument("--systems", help="the side by side's rows, a comma-separated subset of "
                                      f"{','.join(gpu_parts.GPU.systems)} (default: all, in that order)")
    p.add_argument("--work-dir", help="NVMe files and logs (its disk is the one measured; default: a new temporary "
                                      "directory, removed at the end)")
    p.add_argument("--jobs", type=int, help="tasks at a time (default 1 on a GPU, 3 smoke)")
    p.add_argument("--commit", help="the zinf commit of this tree, where it is no git checkout (a copied tree)")
    args = p.parse_args()
    import torch

    settings = gpu_parts.SMOKE if args.smoke else gpu_parts.GPU
    if args.systems:
        chosen = args.systems.split(",")
        unknown = [s for s in chosen if s not in settings.systems]
        if unknown:
            raise SystemExit(f"--systems: unknown {unknown}; choose from {','.join(settings.systems)}")
        settings = dataclasses.replace(settings, systems=tuple(chosen))
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("gpu_check.py: torch sees no CUDA device; on a CPU run --smoke")
    budget_s = args.budget_s or (280.0 if args.smoke else 390.0)
    deadline = time.monotonic() + budget_s
    start = time.monotonic()
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="zinf-gpu-check-")
    os.makedirs(work_dir, exist_ok=True)
    parts = gpu_parts.parts(settings)
    if args.parts:
        keys = args.parts.split(",")
        unknown = [k for k in keys if k not in {pt.key for pt in parts}]
        if unknown:
            raise SystemExit(f"--parts: unknown {unknown}; choose from {','.join(pt.key for pt in parts)}")
        parts = [pt for pt in parts if pt.key in keys]
    meta = describe(settings, device, " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]), budget_s,
                    args.commit)
    folder = results_folder(args.out, meta)
    print(f"zinf GPU check: {meta.get('gpu') or 'CPU (smoke)'}, driver {meta.get('driver', '-')}, torch "
          f"{meta['versions']['torch']} (CUDA {meta.get('cuda', '-')}), bf16 matmul peak "
          f"{gpu_report.flops(meta['peak_flops'])}; results: {folder}", flush=True)
    results: dict = {"meta": meta, "parts": {}}
    check = Check(settings=settings, device=device, results_dir=folder, work_dir=work_dir,
                  peak_flops=meta["peak_flops"], threads=max(1, (os.cpu_count() or 1) // (args.jobs or 1)))

    def on_done(part: Part, record: dict) -> None:
        results["parts"][part.key] = record
        meta["wall_s"] = time.monotonic() - start
        write(folder, results)
        print(f"{part.title:<40} {record['status']:<9} {record['elapsed_s']:5.0f} s  {record['note'][:300]}", flush=True)

    try:
        run_parts(check, parts, deadline, args.jobs or (3 if args.smoke else 1), on_done)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print()
    for g in results["goals"]:
        print(f"{g['result']:<13} {g['goal']}: {g['measured']}")
    print(f"\n{folder}/summary.md ({meta['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
