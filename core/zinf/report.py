"""Where a step's time and memory go: compute, all-gather, reduce-scatter, optimizer, buffer broadcast; bytes per
tier."""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from zinf.device_memory import is_device_memory

__all__ = ["StepTimers", "StepReport", "io_hidden_share", "disk_utilisation", "io_overlap", "tier_of"]


def tier_of(t: torch.Tensor) -> str:
    return "device" if is_device_memory(t) else "cpu"


class StepTimers:
    """Wall-clock seconds per category, accumulated until ``take()``. On CUDA the waits are host-side
    waits, which is where time is lost when communication is not hidden. The waits for NVMe I/O and for the
    background optimizer step are also kept as intervals, from which ``take()`` adds the step's I/O overlap
    (see [Note: I/O hidden share])."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._since = time.perf_counter()
        self._faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    @contextmanager
    def time(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.seconds[category] += end - start
            self.counts[category] += 1
            if category in INTERVAL_CATEGORIES:
                self.intervals[category].append((start, end))  # one append: safe from any thread

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self.counts[category] += 1

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The step's seconds and counts since the last ``take``; with NVMe waits, also ``io_busy`` (the time any
        thread waited for NVMe I/O), ``io_stalled`` (the part of it the training thread stood still for) and
        ``step_wall`` (the wall time since the last ``take``)."""
        now = time.perf_counter()
        seconds, counts = dict(self.seconds), dict(self.counts)
        intervals = {k: list(v) for k, v in self.intervals.items()}
        self.seconds.clear()
        self.counts.clear()
        self.intervals.clear()
        seconds["step_wall"], self._since = now - self._since, now
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # pages first touched (or faulted back) this step
        counts["minor_faults"], self._faults = faults - self._faults, faults
        seconds.update(io_overlap(intervals))
        return seconds, counts


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def io_overlap(intervals: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """``io_busy`` and ``io_stalled`` of [Note: I/O hidden share] from the waits' intervals; nothing without NVMe
    waits."""
    foreground = _union(intervals.get("nvme_read", []) + intervals.get("nvme_write", []))
    background = _union(intervals.get("background_nvme_read", []) + intervals.get("background_nvme_write", []))
    if not foreground and not background:
        return {}
    stalled = _union(foreground + [(max(a, c), min(b, d)) for a, b in _union(intervals.get("optimizer_wait", []))
                                   for c, d in background if min(b, d) > max(a, c)])
    return {"io_busy": _length(_union(foreground + background)), "io_stalled": _length(stalled)}


# the categories summary() prints, in order; the optional ones only when the step timed them
SUMMARY_CATEGORIES = ("compute", "all_gather", "reduce_scatter", "optimizer", "broadcast_buffers", "nvme_read",
                      "nvme_write", "background_nvme_read", "background_nvme_write", "optimizer_wait", "adam",
                      "adam_early", "heap_trim", "nvme_floor")
OPTIONAL_CATEGORIES = frozenset(SUMMARY_CATEGORIES[4:])
NVME_CATEGORIES = ("nvme_read", "nvme_write", "background_nvme_read", "background_nvme_write")
INTERVAL_CATEGORIES = frozenset(NVME_CATEGORIES + ("optimizer_wait",))


# [Note: I/O hidden share]
# How much of the step's NVMe I/O ran while training went on, from the intervals of the waits (StepTimers):
#     io_busy    = the time any thread waited for NVMe I/O (the training thread's nvme_read / nvme_write, the
#                  background optimizer's background_nvme_read / _write), each instant counted once
#     io_stalled = the time the training thread stood still for it: its own NVMe waits, and the part of its waits
#                  for the background optimizer step (optimizer_wait: a gather waiting for its group's update, the
#                  next step waiting for the last one to finish) during which that step waited for I/O
#     io         = max(io_busy, nvme_floor)  (nvme_floor: the step's bytes at the measured disk speed, where known:
#                  I/O that finished before anyone waited for it still took the disk that long)
#     io_hidden_share = 1 - io_stalled / io
# It is None when the step did no NVMe I/O, and 1.0 when it moved NVMe bytes without any measurable wait. The
# figures add up over steps (io_hidden_share of the sums is the share of a run). ``disk_utilisation`` is
# nvme_floor / step_wall: how much of the step the disk needed at its measured speed.
def io_hidden_share(seconds: dict[str, float], counts: dict[str, int]) -> float | None:
    """See [Note: I/O hidden share]."""
    io = max(seconds.get("io_busy", 0.0), seconds.get("nvme_floor", 0.0))
    if io <= 0.0:
        moved = counts.get("nvme_read_bytes", 0) + counts.get("nvme_written_bytes", 0)
        timed = any(key in seconds for key in NVME_CATEGORIES)
        return 1.0 if (moved or timed) else None
    return max(0.0, 1.0 - seconds.get("io_stalled", 0.0) / io)


def disk_utilisation(seconds: dict[str, float]) -> float | None:
    """See [Note: I/O hidden share]; None without a measured disk speed."""
    floor, wall = seconds.get("nvme_floor"), seconds.get("step_wall", 0.0)
    return None if floor is None or wall <= 0 else floor / wall


@dataclass
class StepReport:
    """One optimizer step. ``seconds``: forward, backward and step wall time, and inside them the
    host waits for all_gather and reduce_scatter; ``compute`` is forward + backward minus those waits;
    with NVMe offload, ``nvme_read`` / ``nvme_write`` are the training thread's waits for swap-file I/O
    (reads of parameter shards fall inside the all-gather waits; optimizer-state I/O inside
    ``optimizer``), ``background_nvme_read`` / ``background_nvme_write`` the background optimizer step's
    (hidden unless the training thread waits for that step: ``optimizer_wait``, inside ``all_gather`` where a gather
    waits for its group's update, inside ``optimizer`` where the next step waits for the last one; where the training
    thread runs that step itself, [Note: a sweep the gathers drive], the wait holds its work and its I/O waits are
    the training thread's), and counts hold
    ``nvme_read_bytes`` / ``nvme_written_bytes``. ``broadcast_buffers`` (with several ranks and a model with
    buffers) is the forward's wait for rank 0's buffers (see [Note: buffers like DDP] in zinf/schedule/buffers.py),
    outside ``compute`` like the other waits. With the optimizer offloaded, ``adam`` is the CPU-Adam's own time
    (with a background step it runs after the report of its step, so it falls in the next one's) and
    ``adam_early`` that of the steps begun during the backward (``offload.step_during_backward``); with NVMe and a
    speed ``zinf info --nvme`` measured, ``nvme_floor`` is the time the step's NVMe bytes take at that speed
    (zinf/offload/disk_speed.py). ``heap_trim`` (CPU compute, parameters offloaded) is the time the forward and backward
    spent handing freed host memory back (``trim_heap_bytes``; [Note: heap growth] in zinf/heap.py), outside
    ``compute``.
    ``bytes``: tier ("device", "cpu", "nvme") -> kind (param_shards, master, grad_shards,
    optimizer_state, gathered) -> bytes resident at the end of the step, plus the gathered peak. ``peak_host_bytes``:
    the most host memory the engine held during the step, what it kept across the step and what came and went
    (gathered parameters, flat gradients), [Note: host bytes accounted] in zinf/host_memory.py."""

    step: int
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_gathered_bytes: int = 0
    peak_host_bytes: int = 0
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None

    @property
    def io_hidden_share(self) -> float | None:
        """The share of this step's NVMe I/O that did not stall the training thread, in [0, 1]; None when the step
        did no NVMe I/O. See [Note: I/O hidden share]."""
        return io_hidden_share(self.seconds, self.counts)

    @property
    def disk_utilisation(self) -> float | None:
        """The step's NVMe bytes at the measured disk speed over the step's wall time; None without a measured
        speed. See [Note: I/O hidden share]."""
        return disk_utilisation(self.seconds)

    def metrics(self) -> dict[str, float]:
        """A flat ``{"zinf/<name>": value}`` dict for experiment loggers (Lightning, Accelerate trackers):
        ``zinf/<category>`` seconds for every timed category (always compute, all_gather, reduce_scatter and
        optimizer, 0.0 when not timed; forward, backward, broadcast_buffers, and nvme_read / nvme_write /
        background_nvme_read / background_nvme_write / optimizer_wait where present); ``zinf/bytes_<tier>`` resident bytes per
        tier (device, cpu, nvme), ``zinf/peak_gathered_bytes`` and ``zinf/peak_host_bytes``; ``zinf/nvme_read_bytes`` /
        ``zinf/nvme_written_bytes``, ``zinf/prefetched_gathers`` / ``zinf/demand_gathers``;
        ``zinf/grad_norm`` and ``zinf/loss_scale`` when set; ``zinf/io_hidden_share`` with NVMe I/O;
        ``zinf/skipped`` (1.0 when the step was skipped on overflow)."""
        seconds = {**{key: 0.0 for key in SUMMARY_CATEGORIES if key not in OPTIONAL_CATEGORIES}, **self.seconds}
        out: dict[str, float] = {f"zinf/{key}": float(value) for key, value in sorted(seconds.items())}
        for tier, kinds in sorted(self.bytes.items()):
            out[f"zinf/bytes_{tier}"] = float(sum(kinds.values()))
        out["zinf/peak_gathered_bytes"] = float(self.peak_gathered_bytes)
        out["zinf/peak_host_bytes"] = float(self.peak_host_bytes)
        for key in ("nvme_read_bytes", "nvme_written_bytes", "prefetched_gathers", "demand_gathers"):
            if key in self.counts:
                out[f"zinf/{key}"] = float(self.counts[key])
        if self.grad_norm is not None:
            out["zinf/grad_norm"] = float(self.grad_norm)
        if self.loss_scale is not None:
            out["zinf/loss_scale"] = float(self.loss_scale)
        share = self.io_hidden_share
        if share is not None:
            out["zinf/io_hidden_share"] = share
        busy = self.disk_utilisation
        if busy is not None:
            out["zinf/disk_utilisation"] = busy
        out["zinf/skipped"] = 1.0 if self.skipped else 0.0
        return out

    def summary(self) -> str:
        """One line: ``step N | <category> X ms | ... | <tier> Y MiB | io_hidden Z% | skipped (overflow)``
        (``zinf report`` parses it back; keep the ``name value unit`` parts)."""
        s = self.seconds
        parts = [f"step {self.step}"]
        for key in SUMMARY_CATEGORIES:
            if key in s or key not in OPTIONAL_CATEGORIES:
                parts.append(f"{key} {s.get(key, 0.0) * 1e3:.1f} ms")
        for tier, kinds in sorted(self.bytes.items()):
            parts.append(f"{tier} {sum(kinds.values()) / 2**20:.1f} MiB")
        share = self.io_hidden_share
        if share is not None:
            parts.append(f"io_hidden {share * 100:.0f}%")
        busy = self.disk_utilisation
        if busy is not None:
            parts.append(f"disk_busy {busy * 100:.0f}%")
        if self.skipped:
            parts.append("skipped (overflow)")
        return " | ".join(parts)
