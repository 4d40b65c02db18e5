"""``benchmarks/bench_gather_buffers.py`` runs and prints its table; a buffer larger than glibc's largest mmap
threshold (32 MiB) faults its pages in at every fresh allocation, none through the gather buffer cache, and a miss
of the cache faults in huge pages where the kernel gives them on request. No timing is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gather_buffers.py"


def test_the_cache_takes_no_fresh_pages_where_torch_takes_them_all() -> None:
    numel = 12 << 20  # 48 MiB of fp32
    done = subprocess.run([sys.executable, str(SCRIPT), "--numel", str(numel), "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| buffer |", "| ---"))}
    faults = {name: float(cells[2].replace(",", "")) for name, cells in rows.items()}
    miss = "through the cache, a miss each time (huge pages)"
    assert set(faults) == {"fresh buffer (torch.empty)", "same storage, through the cache", miss,
                           "buffer kept (the copy alone)"}
    pages = numel * 4 // 4096
    assert faults["fresh buffer (torch.empty)"] >= pages * 0.9, done.stdout
    assert faults["same storage, through the cache"] < pages / 100, done.stdout
    if _huge_pages_on_request():
        assert faults[miss] < pages / 2, done.stdout  # 2 MiB pages: 512 times fewer faults where all are huge


def _huge_pages_on_request() -> bool:
    """Whether transparent huge pages are given to a region that asks for them (``madvise`` or ``always``)."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def test_blocks_smaller_than_a_huge_page_take_the_same_path() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--numel", "1024", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "through the cache, a miss each time" in done.stdout
