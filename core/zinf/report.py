"""Where a step's time and memory go: compute, all-gather, reduce-scatter, optimizer; bytes per tier."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["StepTimers", "StepReport", "tier_of"]


def tier_of(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else "device"


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


@dataclass
class StepReport:
    """One optimizer step. ``seconds``: forward, backward and step wall time, and inside them the
    host waits for all_gather and reduce_scatter; ``compute`` is forward + backward minus those waits;
    with NVMe offload, ``nvme_read`` / ``nvme_write`` are the training thread's waits for swap-file I/O
    (reads of parameter shards fall inside the all-gather waits; optimizer-state I/O inside
    ``optimizer``), ``background_nvme_read`` / ``background_nvme_write`` the background optimizer step's
    (hidden unless a gather waits for that step: ``optimizer_wait``, inside ``all_gather``), and counts hold
    ``nvme_read_bytes`` / ``nvme_written_bytes``.
    ``bytes``: tier ("device", "cpu", "nvme") -> kind (param_shards, master, grad_shards,
    optimizer_state, gathered) -> bytes resident at the end of the step, plus the gathered peak."""

    step: int
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_gathered_bytes: int = 0
    skipped: bool = False
    grad_norm: float | None = None
    loss_scale: float | None = None

    def summary(self) -> str:
        s = self.seconds
        parts = [f"step {self.step}"]
        for key in ("compute", "all_gather", "reduce_scatter", "optimizer", "nvme_read", "nvme_write"):
            if key in s or not key.startswith("nvme"):
                parts.append(f"{key} {s.get(key, 0.0) * 1e3:.1f} ms")
        for tier, kinds in sorted(self.bytes.items()):
            parts.append(f"{tier} {sum(kinds.values()) / 2**20:.1f} MiB")
        if self.skipped:
            parts.append("skipped (overflow)")
        return " | ".join(parts)
