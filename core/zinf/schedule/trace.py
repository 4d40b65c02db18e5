"""The module order of one pass (forward or backward), recorded once and replayed to drive prefetch.

The first pass records; later passes compare each module against the recording. The first
mismatch marks the trace invalid and prefetching stops for the rest of the pass (demand gathers are
still issued in program order, so the ranks stay in step). At the end of the pass the ranks agree,
by one small all-reduce, on whether any of them saw a mismatch; if so every rank records afresh.
"""

from __future__ import annotations

import enum
import logging

import torch
from torch import nn

from zinf.fetch.comm import Comm

__all__ = ["TraceState", "ModuleTrace"]

log = logging.getLogger(__name__)


class TraceState(enum.Enum):
    """RECORDING: the order is being written down, no prefetch. REPLAYING: the order is known and
    prefetch follows it. DIVERGED: this pass left the recorded order; no prefetch until re-recorded."""

    RECORDING = "recording"
    REPLAYING = "replaying"
    DIVERGED = "diverged"


class ModuleTrace:
    def __init__(self, name: str, comm: Comm) -> None:
        self.name = name
        self.comm = comm
        self.state = TraceState.RECORDING
        self.order: list[nn.Module] = []
        self._recording: list[nn.Module] = []
        self.position = 0
        self.num_rerecords = 0

    def visit(self, module: nn.Module) -> int | None:
        """Note that ``module`` runs now; return its position in the recorded order when replaying in step."""
        if self.state is TraceState.RECORDING:
            self._recording.append(module)
            return None
        if self.state is TraceState.DIVERGED:
            return None
        if self.position < len(self.order) and self.order[self.position] is module:
            self.position += 1
            return self.position - 1
        log.info("zinf: %s order changed at position %d; prefetch off until re-recorded", self.name, self.position)
        self.to_diverged()
        return None

    def to_diverged(self) -> None:
        assert self.state is TraceState.REPLAYING, f"trace {self.name}: diverge from {self.state}"
        self.state = TraceState.DIVERGED

    def finish_pass(self) -> None:
        """End of a pass: the ranks agree whether to replay or record again."""
        if self.state is TraceState.REPLAYING and self.position != len(self.order):
            self.to_diverged()  # a shorter pass than the recording
        diverged = torch.tensor([1.0 if self.state is TraceState.DIVERGED else 0.0], device=self.comm.device)
        if self.comm.world > 1:
            self.comm.all_reduce(diverged, op="max")
        if self.state is TraceState.RECORDING:
            self.order, self._recording = self._recording, []
            self.state = TraceState.REPLAYING
        elif diverged.item() > 0:
            self.num_rerecords += 1
            self.order, self._recording = [], []
            self.state = TraceState.RECORDING
        self.position = 0
