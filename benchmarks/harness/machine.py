"""The machine a benchmark ran on: its measured fp32 matmul peak and a description (CPU, memory, versions)."""

from __future__ import annotations

import os
import platform
import subprocess
import time

import torch


def matmul_peak_flops(n: int = 4096, repeats: int = 5, device: str = "cpu") -> float:
    """The best FLOP/s of an fp32 ``n x n`` torch.mm over ``repeats`` runs after one warm-up, with all the
    threads this process has (CPU) or on one GPU: the machine's fp32 matmul peak as torch reaches it."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


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


def versions(ds_python: str | None) -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
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


def describe(device: str, peak_n: int, ds_python: str | None) -> dict:
    """Everything the tables' header and docs/benchmarks.md say about the machine, with the measured peak."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = {"cpu": lscpu_summary(), "memory_gib": round(mem_gib, 1), "threads": torch.get_num_threads(),
            "device": device, "versions": versions(ds_python)}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["matmul_n"] = peak_n
    info["peak_flops"] = matmul_peak_flops(peak_n, device=device)
    return info
