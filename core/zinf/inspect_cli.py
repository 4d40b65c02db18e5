"""``zinf info`` and ``zinf report``: what this installation can do, and where a run's time went.

``zinf info [--nvme PATH ...]`` prints the versions and the native build, and measures each path's
sequential O_DIRECT write and read speed through zinf's own :class:`zinf.native.AsyncIO` (the
settings the offload engine uses: ``offload.aio_block_bytes``, ``aio_queue_depth``, ``aio_threads``).

``zinf report LOGFILE`` reads the per-step lines the engine logs (``zinf: step N | compute X ms | ...``,
:meth:`zinf.StepReport.summary`, every ``log_every_n_steps`` optimizer steps) and prints their summary.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
from dataclasses import dataclass, field
from typing import TextIO

from zinf.report import OPTIONAL_CATEGORIES, SUMMARY_CATEGORIES

__all__ = ["ParsedStep", "info", "parse_log", "parse_summary", "report"]


# -- zinf info ------------------------------------------------------------------------------------------
def info(out: TextIO, nvme_paths: list[str] | None = None, size_bytes: int = 256 * 2**20,
         bytes_per_s: float = 0.0) -> int:
    import torch

    import zinf
    from zinf import native
    from zinf.errors import ConfigError
    from zinf.offload.disk_speed import measure_path, measured_bytes, save_speed

    if nvme_paths and size_bytes < 2**20:
        raise ConfigError(f"--size-mib {size_bytes / 2**20:g} is too small to measure a drive; give at least "
                          "--size-mib 1 (default 256)")

    built = native.info()
    lines = [
        f"zinf {zinf.__version__}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, "
        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} device(s) visible)",
        f"Python {platform.python_version()} ({platform.system()} {platform.machine()})",
    ]
    if built.available:
        lines += [
            "native build: loaded",
            f"  CPU-Adam SIMD level: {built.simd_level}",
            f"  OpenMP threads:      {built.num_threads}",
            f"  async I/O backend:   {built.io_backend}",
            f"  checksum backend:    {native.checksum_backend()}",
        ]
    else:
        lines += [
            "native build: MISSING (pure-Python fallbacks: slower CPU-Adam, no NVMe offload)",
            f"  why: {built.error}",
            f"  fix: {native._BUILD_HINT}",
        ]
    from zinf.native.buffer_cache import buffer_cache, unavailable_reason

    cache = buffer_cache()
    lines.append(f"gather buffer cache: built ({cache.path})" if cache is not None else
                 f"gather buffer cache: MISSING (gathers on the CPU take fresh memory each time)\n  why: "
                 f"{unavailable_reason()}")
    out.write("\n".join(lines) + "\n")
    status = 0
    for path in nvme_paths or []:
        try:
            write_gbs, read_gbs, mixed_gbs, direct = measure_path(path, size_bytes, bytes_per_s)
        except (OSError, ImportError, ValueError) as exc:
            out.write(f"nvme {path}: not measured: {exc}\n")
            status = 1
            continue
        mode = "O_DIRECT" if direct else "buffered: the file system refused O_DIRECT, so reads may come from the page cache"
        if bytes_per_s:
            mode += f", capped at {bytes_per_s / 1e9:.3g} GB/s"
        out.write(f"nvme {path}: write {write_gbs:.2f} GB/s, read {read_gbs:.2f} GB/s, both at once {mixed_gbs:.2f} "
                  f"GB/s ({_mib(measured_bytes(size_bytes))} sequential, {mode})\n")
        # an engine's step report compares its NVMe bytes with it
        save_speed(path, write_gbs, read_gbs, direct, mixed_gbs=mixed_gbs, bytes_per_s=bytes_per_s)
    return status


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes % 2**20 == 0 else f"{nbytes / 2**20:.3f} MiB"


# -- zinf report ----------------------------------------------------------------------------------------
_LINE = re.compile(r"zinf: step (\d+)( \|.*)$")
_TIME = re.compile(r"^([a-z_]+) ([0-9.]+) ms$")
_BYTES = re.compile(r"^([a-z]+) ([0-9.]+) MiB$")
_HIDDEN = re.compile(r"^io_hidden ([0-9.]+)%$")
_DISK = re.compile(r"^disk_busy ([0-9.]+)%$")


# what the training thread's step is made of: compute and what the engine took out of it (zinf/engine.py,
# _finish_report), and the optimizer step
_STEP_PARTS = ("compute", "all_gather", "reduce_scatter", "optimizer", "broadcast_buffers", "heap_trim")
# no share of the step: ran on the background thread, or (adam with an overlapped optimizer step) may have;
# nvme_floor is a bound on the disk's time, not time spent
_NO_SHARE = frozenset({"background_nvme_read", "background_nvme_write", "adam", "nvme_floor"})


@dataclass
class ParsedStep:
    """One ``StepReport.summary()`` line read back: milliseconds per category, MiB per tier."""

    step: int
    ms: dict[str, float] = field(default_factory=dict)
    mib: dict[str, float] = field(default_factory=dict)
    io_hidden_share: float | None = None
    skipped: bool = False
    disk_utilisation: float | None = None

    @property
    def step_ms(self) -> float:
        """The training thread's time: compute + the times the engine takes out of it (waits, heap trims) + the
        optimizer step (the other categories are parts of these, ran on the background thread, or are a bound)."""
        return sum(self.ms.get(k, 0.0) for k in _STEP_PARTS)


def parse_summary(line: str) -> ParsedStep | None:
    match = _LINE.search(line)
    if match is None:
        return None
    ms: dict[str, float] = {}
    mib: dict[str, float] = {}
    hidden: float | None = None
    disk: float | None = None
    skipped = False
    for part in match.group(2).split("|")[1:]:
        part = part.strip()
        if m := _TIME.match(part):
            ms[m.group(1)] = float(m.group(2))
        elif m := _BYTES.match(part):
            mib[m.group(1)] = float(m.group(2))
        elif m := _HIDDEN.match(part):
            hidden = float(m.group(1)) / 100
        elif m := _DISK.match(part):
            disk = float(m.group(1)) / 100
        elif part.startswith("skipped"):
            skipped = True
    return ParsedStep(int(match.group(1)), ms, mib, hidden, skipped, disk)


def parse_log(path: str) -> list[ParsedStep]:
    with open(path, errors="replace") as f:
        return [s for s in map(parse_summary, f) if s is not None]


_WHERE = {"nvme_read": "inside all_gather / optimizer", "nvme_write": "inside all_gather / optimizer",
          "optimizer_wait": "inside all_gather / optimizer", "background_nvme_read": "background thread",
          "background_nvme_write": "background thread"}


def report(path: str, out: TextIO, err: TextIO) -> int:
    if not os.path.isfile(path):
        err.write(f"zinf report: {path} is not a file\n")
        return 2
    steps = parse_log(path)
    if not steps:
        err.write(f"zinf report: {path} has no zinf step lines (lines like 'zinf: step 10 | compute 12.3 ms | ...').\n"
                  "The engine logs one every `log_every_n_steps` optimizer steps (zinf config; 0, the default, logs "
                  "none) at INFO level on rank 0: set it, and let INFO records of the 'zinf' logger through "
                  "(e.g. logging.basicConfig(level=logging.INFO)).\n")
        return 1
    num_skipped = sum(s.skipped for s in steps)
    out.write(f"{path}: {len(steps)} step reports, steps {steps[0].step} .. {steps[-1].step}"
              + (f", {num_skipped} skipped (fp16 overflow)" if num_skipped else "") + "\n")
    totals = [s.step_ms for s in steps]
    mean_total = statistics.fmean(totals)
    out.write(f"\n{'step time':<24}{'mean ms':>10}{'median ms':>11}{'share':>8}\n")
    out.write(f"{'total':<24}{mean_total:>10.1f}{statistics.median(totals):>11.1f}{'100%':>8}\n")
    for key in SUMMARY_CATEGORIES:
        values = [s.ms.get(key, 0.0) for s in steps]
        if key in OPTIONAL_CATEGORIES and not any(key in s.ms for s in steps):
            continue
        mean = statistics.fmean(values)
        share = f"{mean / mean_total * 100:.0f}%" if mean_total > 0 and key not in _NO_SHARE else "-"
        note = f"  ({_WHERE[key]})" if key in _WHERE else ""
        name = f"  {key}" if key in _WHERE else key
        out.write(f"{name:<24}{mean:>10.1f}{statistics.median(values):>11.1f}{share:>8}{note}\n")
    out.write(f"\nresident at step {steps[-1].step}: "
              + (", ".join(f"{tier} {mib:.1f} MiB" for tier, mib in sorted(steps[-1].mib.items())) or "none") + "\n")
    out.write(_hidden_line(steps) + "\n")
    busy = [s.disk_utilisation for s in steps if s.disk_utilisation is not None]
    if busy:
        out.write(f"disk busy: {statistics.fmean(busy) * 100:.0f}% of the step on average (the step's NVMe bytes at "
                  f"the speed zinf info --nvme measured; highest step {max(busy) * 100:.0f}%)\n")
    return 0


def _hidden_line(steps: list[ParsedStep]) -> str:
    """The run's I/O hidden share: each step's share weighted by its NVMe wait time (see [Note: I/O hidden
    share] in zinf/report.py)."""
    with_io = [s for s in steps if s.io_hidden_share is not None]
    if not with_io:
        if any(k in s.ms for s in steps for k in ("nvme_read", "nvme_write")):
            return "NVMe I/O hidden share: not in this log (its lines predate the io_hidden field)"
        return "NVMe I/O hidden share: no NVMe I/O in this run"
    io_ms = [sum(s.ms.get(k, 0.0) for k in ("nvme_read", "nvme_write", "background_nvme_read",
                                              "background_nvme_write")) for s in with_io]
    weight = sum(io_ms)
    if weight > 0:
        share = sum(s.io_hidden_share * ms for s, ms in zip(with_io, io_ms)) / weight  # type: ignore[operator]
    else:
        share = statistics.fmean(s.io_hidden_share for s in with_io)  # type: ignore[misc]
    low = min(s.io_hidden_share for s in with_io)  # type: ignore[type-var]
    return (f"NVMe I/O hidden share: {share * 100:.0f}% of the NVMe I/O ran while the training thread went on "
            f"(lowest step {low * 100:.0f}%, {len(with_io)} steps with NVMe I/O)")
