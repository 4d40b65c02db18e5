"""The parts of benchmarks/gpu_check.py: what each runs, with what settings, and what it records.

A part is a list of tasks (each one process or one harness run, given a time limit) and a function that turns their
results into the part's record: ``status`` (passed, failed, skipped, timed out), a one-line ``note`` and its figures.
Every task kills what it started when its limit passes, so one hung part cannot eat the call."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any, Callable

from harness import systems
from harness.watchdog import Limits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST_OVERHEAD = os.path.join(ROOT, "benchmarks", "bench_host_overhead.py")
PROFILE_CHILD = os.path.join(ROOT, "benchmarks", "harness", "profile_steps.py")
RANKS_RTOL = 2e-5  # fp32, two ranks against one process: only the order of the gradient's sums differs


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one check runs. ``steps``: per system of the side by side, (steps, warm-up steps left out)."""

    smoke: bool
    model: str  # the side by side's GPT (harness/models.py)
    global_batch: int
    steps: dict[str, tuple[int, int]]
    ranks_model: str  # two ranks on one device, fp32, against plain PyTorch
    ranks_batch: int
    ranks_steps: int
    profile_model: str
    profile_batch: int
    profile_steps: tuple[int, int]  # (warm-up, profiled)
    peak_n: int  # the bf16 matmul that measures the peak
    nvme_test_mib: int
    rss_limit_gib: float
    part_limits_s: dict[str, float]
    test_timeout_s: int  # pytest-timeout, per test
    test_workers: int  # pytest-xdist workers for tests/gpu where it is installed (1: none)
    run_cap_s: float  # one harness run at most
    precision: str = "bf16"
    nvme_model: str = ""  # the NVMe row's model where it differs ("": ``model``)
    ranks_systems: tuple[str, ...] = ("zinf-mem", "zinf-optcpu")
    # the rows the goals are judged on first: what is cut short when time runs out is the last
    systems: tuple[str, ...] = ("plain", "fsdp2", "zinf-mem", "zinf-mem+compile", "fsdp2+compile", "fsdp2-offload",
                                "zinf-optcpu", "zinf-optcpu-share", "zinf-nvme", "zinf-nvme-gradcpu", "zinf-cpu")


# zinf's first step records the trace and its second is the first to prefetch: two warm-up steps for zinf, one on
# NVMe (a step moves the optimizer states twice: about 25 GB at this size); FSDP2's CPUOffloadPolicy steps with
# torch's AdamW on the CPU (seconds a step at this size): one
_FAST, _OFFLOADED = (6, 2), (4, 2)
# compiled: zinf's first step runs eagerly (it records), its second compiles; FSDP2 compiles in its first
_COMPILED = (6, 3)
GPU = Settings(smoke=False, model="gpt:xl:L18", global_batch=32,  # 0.97B parameters, 5.95 GFLOP a token
               steps={"plain": _FAST, "fsdp2": _FAST, "zinf-mem": _FAST, "zinf-mem+compile": _COMPILED,
                      "fsdp2+compile": _COMPILED, "fsdp2-offload": (3, 1),
                      "zinf-optcpu": _OFFLOADED, "zinf-optcpu-share": _OFFLOADED, "zinf-cpu": _OFFLOADED, "zinf-nvme": (2, 1),
                      "zinf-nvme-gradcpu": (2, 1)},
               ranks_model="gpt:small", ranks_batch=8, ranks_steps=6, profile_model="gpt:large", profile_batch=8,
               profile_steps=(3, 3), peak_n=8192, nvme_test_mib=1024, rss_limit_gib=100.0, test_timeout_s=120,
               test_workers=2, run_cap_s=120,
               nvme_model="gpt:xl:L6",  # 0.37B: building 0.97B straight to NVMe took over the minute left there
               part_limits_s={"tests": 150, "nvme": 30, "ranks": 60, "host": 75, "side_by_side": 280})
SMOKE = Settings(smoke=True, model="gpt:tiny", global_batch=2, steps={s: (2, 1) for s in GPU.systems},
                 ranks_model="gpt:tiny", ranks_batch=2, ranks_steps=3, profile_model="gpt:tiny", profile_batch=2,
                 profile_steps=(1, 1),
                 ranks_systems=("zinf-optcpu",),  # its gathers, reduce-scatters and copy-out: one run fewer in CI
                 peak_n=256, nvme_test_mib=16, rss_limit_gib=8.0, test_timeout_s=60, test_workers=1, run_cap_s=90,
                 part_limits_s={"tests": 120, "nvme": 60, "ranks": 120, "host": 120, "side_by_side": 120})


@dataclass
class Check:
    """One check's shared state: settings, the device, where files go, the measured peak."""

    settings: Settings
    device: str
    results_dir: str
    work_dir: str
    peak_flops: float
    threads: int


@dataclass
class Part:
    key: str
    title: str
    tasks: list[tuple[str, Callable[[Check, float], dict]]]
    combine: Callable[[Check, dict[str, dict]], dict]


def run_command(cmd: list[str], limit_s: float, log_path: str | None = None, env: dict | None = None) -> dict:
    """Run ``cmd`` in the repository in a process group of its own; past ``limit_s`` the whole group is killed."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=max(1.0, limit_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if log_path:
        with open(log_path, "w") as f:
            f.write(out)
    return {"rc": proc.returncode, "output": out, "timed_out": timed_out, "elapsed_s": time.perf_counter() - start}


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _harness(check: Check, limit_s: float, system: str, model: str, *, global_batch: int, steps: int, warmup: int,
             precision: str, ranks: int = 1, tag: str = "", **kw: Any) -> dict:
    from harness.launch import run_system

    limits = Limits(rss_gib=check.settings.rss_limit_gib, cap_s=min(limit_s, check.settings.run_cap_s))
    return run_system(system, model, ranks=ranks, global_batch=global_batch, steps=steps, warmup=warmup,
                      threads=check.threads, limits=limits, work_dir=check.work_dir, ds_python="", device=check.device,
                      peak_flops=check.peak_flops, tag=tag, precision=precision, **kw)


# -- 1. tests/gpu ---------------------------------------------------------------------------------------
def _tests_task(check: Check, limit_s: float) -> dict:
    xml = os.path.join(check.work_dir, "gpu-tests.xml")
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={check.settings.test_timeout_s}")
    if check.settings.test_workers > 1 and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(check.settings.test_workers)]  # each test is mostly its ranks starting
    # smoke: the CPU's run, also where a GPU is there (the GPU tests skip, as in CI)
    res = run_command(cmd, limit_s, os.path.join(check.results_dir, "pytest.log"),
                      env={"CUDA_VISIBLE_DEVICES": ""} if check.settings.smoke else None)
    res["cases"] = _junit(xml) if os.path.exists(xml) else []
    return res


def _junit(path: str) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = " ".join((child.get("message") or child.text or "").split())[:300]
        cases.append({"test": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                      "outcome": outcome, "message": message})
    return cases


def _tests_combine(check: Check, done: dict[str, dict]) -> dict:
    res = done["pytest"]
    cases = res["cases"]
    count = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "error", "skipped")}
    note = ", ".join(f"{n} {o}" for o, n in count.items() if n) or "no tests collected"
    if res["timed_out"]:
        status = "timed out"
    elif count["failed"] or count["error"] or res["rc"] not in (0, 5):
        status = "failed"
    elif cases and count["skipped"] == len(cases):
        status, note = "skipped", note + " (no CUDA device: pytest skips every GPU test)"
    else:
        status = "passed"
    return {"status": status, "note": note, "cases": cases, "rc": res["rc"], "output_tail": _tail(res["output"])}


# -- 4. zinf info --nvme --------------------------------------------------------------------------------
_NVME = re.compile(r"^nvme (.+): write ([0-9.]+) GB/s, read ([0-9.]+) GB/s, both at once ([0-9.]+) GB/s \((.*)\)$")


def _nvme_task(check: Check, limit_s: float) -> dict:
    path = os.path.join(check.work_dir, "nvme-info")
    os.makedirs(path, exist_ok=True)
    return run_command([sys.executable, "-m", "zinf.cli", "info", "--nvme", path, "--size-mib",
                        str(check.settings.nvme_test_mib)], limit_s)


def _nvme_combine(check: Check, done: dict[str, dict]) -> dict:
    res = done["info"]
    lines = res["output"].strip().splitlines()
    out = {"info": lines, "rc": res["rc"]}
    for line in lines:
        if m := _NVME.match(line.strip()):
            out.update(path=m.group(1), write_gbs=float(m.group(2)), read_gbs=float(m.group(3)),
                       mixed_gbs=float(m.group(4)), mode=m.group(5))
    if res["timed_out"]:
        return {**out, "status": "timed out", "note": "zinf info did not finish"}
    if "read_gbs" not in out:
        return {**out, "status": "failed", "note": _tail(res["output"], 2)}
    return {**out, "status": "passed",
            "note": f"write {out['write_gbs']:.2f} GB/s, read {out['read_gbs']:.2f} GB/s, both at once "
                    f"{out['mixed_gbs']:.2f} GB/s ({out['mode']})"}


# -- 5. two ranks on one device -------------------------------------------------------------------------
def _ranks_task(system: str, ranks: int) -> Callable[[Check, float], dict]:
    def task(check: Check, limit_s: float) -> dict:
        # gloo with the device's tensors: on a GPU both ranks share it
        s = check.settings
        return _harness(check, limit_s, system, s.ranks_model, global_batch=s.ranks_batch, steps=s.ranks_steps,
                        warmup=0, ranks=ranks, precision="fp32", tag="-ranks", backend="gloo", build_on_cpu=True)
    return task


def _ranks_combine(check: Check, done: dict[str, dict]) -> dict:
    ref = done.get("plain")
    rows = list(done.values())
    out: dict = {"rtol": RANKS_RTOL, "rows": rows, "compared": {}}
    if ref is None or ref["status"] != "ok":
        return {**out, "status": "failed", "note": "plain PyTorch did not run" + (f": {ref.get('error')}" if ref else "")}
    bad = []
    for system in check.settings.ranks_systems:
        row = done.get(system)
        if row is None:
            continue  # did not start: named by the caller
        if row["status"] != "ok":
            bad.append(f"{system}: {row['status']}: {row.get('error', '')}"[:300])
            continue
        rel = max(abs(a - b) / abs(a) for a, b in zip(ref["losses"], row["losses"]))
        out["compared"][system] = {"max_rel_loss_diff": rel, "first_step_rel_diff":
                                   abs(ref["losses"][0] - row["losses"][0]) / abs(ref["losses"][0])}
        if not rel <= RANKS_RTOL:
            bad.append(f"{system}: max relative loss difference {rel:.2e} > {RANKS_RTOL:.0e}")
    note = "; ".join(bad) or ", ".join(f"{s} within {v['max_rel_loss_diff']:.1e}" for s, v in out["compared"].items())
    return {**out, "status": "failed" if bad else "passed", "note": note}


# -- 2. host overhead: bench_host_overhead.py and a profiler trace -------------------------------------
def _host_bench_task(check: Check, limit_s: float) -> dict:
    """bench_host_overhead.py (the host work of a step on negligible-width models, on this machine's CPUs, beside
    FSDP2 and plain PyTorch); in smoke mode one model, one rank, three systems."""
    if not os.path.exists(HOST_OVERHEAD):
        return {"absent": True}
    cmd = [sys.executable, HOST_OVERHEAD, "--out", os.path.join(check.work_dir, "host_overhead")]
    if check.settings.smoke:
        cmd += ["--smoke", "--worlds", "1", "--systems", "plain,fsdp2,zinf"]
    else:  # one model, one rank, 10 steps (one model at 1 and 2 ranks, 30 steps, took more than the part's 75 s)
        cmd += ["--models", "gpt2:host", "--worlds", "1", "--steps", "10"]
    res = run_command(cmd, limit_s)
    return {"absent": False, "command": " ".join(cmd[1:]), **res}


def _profile_task(check: Check, limit_s: float) -> dict:
    import json

    s = check.settings
    spec = {"system": "zinf-mem", "model": s.profile_model, "global_batch": s.profile_batch,
            "precision": s.precision, "device": check.device, "warmup": s.profile_steps[0], "steps": s.profile_steps[1]}
    res = run_command([sys.executable, PROFILE_CHILD, json.dumps(spec)], limit_s)
    lines = [ln for ln in res["output"].splitlines() if ln.startswith("RESULT ")]
    res["profile"] = json.loads(lines[-1][7:]) if lines else None
    return res


def _host_combine(check: Check, done: dict[str, dict]) -> dict:
    bench, prof = done.get("bench_host_overhead"), done.get("profile")  # None: did not start (named by the caller)
    out: dict = {"profile": prof["profile"] if prof else None}
    notes, failed = [], False
    if bench is None:
        bench = {}
    elif bench["absent"]:
        notes.append("benchmarks/bench_host_overhead.py is not in this tree: skipped")
    else:
        ok = bench["rc"] == 0 and not bench["timed_out"]
        failed |= not ok
        out["bench"] = {"command": bench["command"], "rc": bench["rc"], "timed_out": bench["timed_out"],
                        "output_tail": _tail(bench["output"], 40)}
        notes.append("bench_host_overhead.py " + ("ran" if ok else "timed out" if bench["timed_out"] else
                                                   f"failed (rc {bench['rc']})"))
    p = out["profile"]
    if prof is None:
        pass
    elif p is None:
        failed = True
        notes.append("profile " + ("timed out" if prof["timed_out"] else "failed: " + _tail(prof["output"], 1)))
        out["profile_output_tail"] = _tail(prof["output"])
    elif p["device_busy_share"] is None:
        notes.append(f"profile: {p['step_ms_mean']:.1f} ms a step on the CPU (launch-bound: not a CPU question)")
    else:
        notes.append(f"profile: {p['step_ms_mean']:.1f} ms a step, device busy {p['device_busy_share'] * 100:.0f}%, "
                     f"{p['launches_per_step']:.0f} launches: " + ("launch-bound" if p["launch_bound"] else
                                                                  "device-bound"))
    status = "failed" if failed else "passed"
    if (prof or {}).get("timed_out") or bench.get("timed_out"):
        status = "timed out"
    return {**out, "status": status, "note": "; ".join(notes)}


# -- 3. side by side ------------------------------------------------------------------------------------
def _sbs_task(system: str) -> Callable[[Check, float], dict]:
    def task(check: Check, limit_s: float) -> dict:
        steps, warmup = check.settings.steps[system]
        model = check.settings.nvme_model if system.startswith("zinf-nvme") and check.settings.nvme_model else \
            check.settings.model
        return _harness(check, limit_s, system, model, global_batch=check.settings.global_batch,
                        steps=steps, warmup=warmup,
                        precision=check.settings.precision)
    return task


def _sbs_combine(check: Check, done: dict[str, dict]) -> dict:
    rows = list(done.values())
    bad = [f"{r['system']}: {r['status']}: {r.get('error', '')}"[:300] for r in rows if r["status"] != "ok"]
    return {"rows": rows, "status": "failed" if bad else "passed",
            "note": "; ".join(bad) or f"{len(rows)} systems ran"}


def parts(settings: Settings) -> list[Part]:
    """In the order they run: the tests first (a failing GPU test is the first thing to fix), the longest last."""
    return [
        Part("tests", "1. tests/gpu", [("pytest", _tests_task)], _tests_combine),
        Part("nvme", "4. zinf info --nvme", [("info", _nvme_task)], _nvme_combine),
        Part("ranks", "5. two ranks on one device (gloo)",
             [("plain", _ranks_task("plain", 1))] + [(s, _ranks_task(s, 2)) for s in settings.ranks_systems],
             _ranks_combine),
        Part("host", "2. host overhead", [("profile", _profile_task), ("bench_host_overhead", _host_bench_task)],
             _host_combine),
        Part("side_by_side", f"3. side by side ({settings.model}, {settings.precision})",
             [(s, _sbs_task(s)) for s in settings.systems if s.partition("+")[0] in systems.SYSTEMS], _sbs_combine),
    ]
