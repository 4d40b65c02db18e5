"""The machine a benchmark ran on: its measured matmul peak (fp32, or bf16 on a GPU) and a description (CPU, memory,
versions, GPU and driver)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Callable

import torch


def matmul_peak_flops(n: int = 4096, repeats: int = 5, device: str = "cpu",
                      dtype: torch.dtype = torch.float32, inner: int = 1) -> float:
    """The best FLOP/s of an ``n x n`` torch.mm in ``dtype`` over ``repeats`` timings after one warm-up, with all
    the threads this process has (CPU) or on one GPU: the machine's matmul peak as torch reaches it. Each timing
    covers ``inner`` products back to back (on a GPU, one product of n=8192 takes about a millisecond: several
    keep the launch and the synchronisation out of the figure). Random operands: zeros run faster."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / inner)
    return 2.0 * n**3 / best


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``fn()``, after one untimed call (first touch, lazy state)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gpu_summary() -> dict[str, str]:
    """The GPU's name, memory and driver (nvidia-smi), and the CUDA version torch was built with; empty without a
    GPU."""
    if not torch.cuda.is_available():
        return {}
    out = {"gpu": torch.cuda.get_device_name(), "cuda": str(torch.version.cuda),
           "gpu_memory_gib": f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"}
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
        out["driver"] = text.splitlines()[0] if text else "unknown (nvidia-smi printed nothing)"
    except (OSError, subprocess.SubprocessError) as exc:
        out["driver"] = f"unknown ({exc})"
    return out


def lscpu_summary() -> str:
    """Model name, CPU count, threads per core, sockets and caches, from lscpu."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown CPU"
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "Hypervisor vendor",
            "L2 cache", "L3 cache")
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return "; ".join(f"{k}: {fields[k]}" for k in keep if k in fields)


def versions(ds_python: str | None, transformers: bool = True) -> dict[str, str]:
    """Python, torch, transformers (unless ``transformers`` is False: its import takes seconds), zinf's commit and
    DeepSpeed's version in ``ds_python``."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        if transformers:
            import transformers as hf

            out["transformers"] = hf.__version__
    except ImportError:
        pass
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out["zinf_commit"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if ds_python and os.path.exists(ds_python):
        proc = subprocess.run([ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                              text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=120)
        out["deepspeed"] = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else \
            "import failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    else:
        out["deepspeed"] = "not installed (no venv)"
    return out


def describe(device: str, peak_n: int, ds_python: str | None, *, dtype: torch.dtype = torch.float32,
             inner: int = 1, transformers: bool = True) -> dict:
    """Everything the tables' header and docs/benchmarks.md say about the machine, with the measured peak (a
    ``peak_n`` matmul in ``dtype``, see matmul_peak_flops)."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"cpu": lscpu_summary(), "memory_gib": round(mem_gib, 1), "threads": torch.get_num_threads(),
            "device": device, "versions": versions(ds_python, transformers)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["matmul_n"] = peak_n
    info["peak_flops"] = matmul_peak_flops(peak_n, device=device, dtype=dtype, inner=inner)
    return info
