"""Where a step's time and memory go: compute, all-gather, reduce-scatter, optimizer, buffer broadcast; bytes per
tier."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from zinf.device_memory import is_device_memory

__all__ = ["StepTimers", "StepReport", "io_hidden_share", "tier_of"]


def tier_of(t: torch.Tensor) -> str:
    return "device" if is_device_memory(t) else "cpu"


class StepTimers:
    """Wall-clock seconds per category, accumulated until ``take()``. On CUDA the waits are host-side
    waits, which is where time is lost when communication is not hidden."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def time(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - start
            self.counts[category] += 1

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self.counts[category] += 1

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        seconds, counts = dict(self.seconds), dict(self.counts)
        self.seconds.clear()
        self.counts.clear()
        return seconds, counts


# the categories summary() prints, in order; the optional ones only when the step timed them
SUMMARY_CATEGORIES = ("compute", "all_gather", "reduce_scatter", "optimizer", "broadcast_buffers", "nvme_read",
                      "nvme_write", "background_nvme_read", "background_nvme_write", "optimizer_wait", "adam",
                      "adam_early", "heap_trim", "nvme_floor")
OPTIONAL_CATEGORIES = frozenset(SUMMARY_CATEGORIES[4:])
NVME_CATEGORIES = ("nvme_read", "nvme_write", "background_nvme_read", "background_nvme_write")


# [Note: I/O hidden share]
# The report holds wait times, not I/O durations. A wait on the training thread (``nvme_read``,
# ``nvme_write``) is I/O the step could not hide: the training thread stood still. A wait on the background
# optimizer thread (``background_nvme_read`` / ``_write``) ran while training went on -- unless the training
# thread in turn waited for that background step (``optimizer_wait``). Counting all of ``optimizer_wait`` as
# stalled I/O (the conservative reading; part of it may be the step's CPU-Adam math), with
#     foreground = nvme_read + nvme_write
#     background = background_nvme_read + background_nvme_write
#     stalled    = foreground + min(optimizer_wait, background)
#     io_hidden_share = (background - min(optimizer_wait, background)) / (foreground + background)
# It is None when the step did no NVMe I/O (no NVMe timings and no NVMe bytes), and 1.0 when it moved NVMe
# bytes without any measurable wait. A prefetched read that finished before the training thread needed it
# waits ~0 s and so weighs ~nothing on either side: the share says how much of the *waiting* for I/O was
# off the training thread, not how much of the bytes were moved in the shadow of compute.
def io_hidden_share(seconds: dict[str, float], counts: dict[str, int]) -> float | None:
    """See [Note: I/O hidden share]."""
    foreground = seconds.get("nvme_read", 0.0) + seconds.get("nvme_write", 0.0)
    background = seconds.get("background_nvme_read", 0.0) + seconds.get("background_nvme_write", 0.0)
    total = foreground + background
    if total <= 0.0:
        moved = counts.get("nvme_read_bytes", 0) + counts.get("nvme_written_bytes", 0)
        timed = any(key in seconds for key in NVME_CATEGORIES)
        return 1.0 if (moved or timed) else None
    hidden = background - min(seconds.get("optimizer_wait", 0.0), background)
    return hidden / total


@dataclass
class StepReport:
    """One optimizer step. ``seconds``: forward, backward and step wall time, and inside them the
    host waits for all_gather and reduce_scatter; ``compute`` is forward + backward minus those waits;
    with NVMe offload, ``nvme_read`` / ``nvme_write`` are the training thread's waits for swap-file I/O
    (reads of parameter shards fall inside the all-gather waits; optimizer-state I/O inside
    ``optimizer``), ``background_nvme_read`` / ``background_nvme_write`` the background optimizer step's
    (hidden unless a gather waits for that step: ``optimizer_wait``, inside ``all_gather``), and counts hold
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
        """The share of this step's NVMe I/O wait time that did not stall the training thread, in [0, 1];
        None when the step did no NVMe I/O. See [Note: I/O hidden share]."""
        return io_hidden_share(self.seconds, self.counts)

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
        if self.skipped:
            parts.append("skipped (overflow)")
        return " | ".join(parts)
