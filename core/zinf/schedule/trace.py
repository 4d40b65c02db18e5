"""The module order of one pass (forward or backward), recorded once and replayed to drive prefetch.

The first pass records; later passes compare each module against the recording. The first
mismatch marks the trace invalid and prefetching stops for the rest of the pass (gathers are issued
through rounds, so the ranks stay in step whatever each one prefetches; see [Note: rounds] in
zinf/schedule/rounds.py). At the end of the pass the ranks agree, in the round that ends the pass, on
whether any of them saw a mismatch; if so every rank records afresh.
"""

from __future__ import annotations

import enum
import logging

from torch import nn

__all__ = ["TraceState", "ModuleTrace"]

log = logging.getLogger(__name__)


class TraceState(enum.Enum):
    """RECORDING: the order is being written down, no prefetch. REPLAYING: the order is known and
    prefetch follows it. DIVERGED: this pass left the recorded order; no prefetch until re-recorded."""

    RECORDING = "recording"
    REPLAYING = "replaying"
    DIVERGED = "diverged"


class ModuleTrace:
    def __init__(self, name: str) -> None:
        self.name = name
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

    @property
    def diverged(self) -> bool:
        """Whether this pass left the recording (or was shorter than it), as seen on this rank."""
        return self.state is TraceState.DIVERGED or (
            self.state is TraceState.REPLAYING and self.position != len(self.order))

    def finish_pass(self, any_diverged: bool) -> None:
        """End of a pass: ``any_diverged`` (agreed by every rank) says whether to replay or record again."""
        if self.state is TraceState.RECORDING:
            self.order, self._recording = self._recording, []
            self.state = TraceState.REPLAYING
        elif any_diverged:
            self.num_rerecords += 1
            self.restart()
        self.position = 0

    def restart(self) -> None:
        """Forget the recording: the next pass records (every rank alike, e.g. after units changed)."""
        self.order, self._recording = [], []
        self.state = TraceState.RECORDING
        self.position = 0

    def abort_pass(self) -> None:
        """The pass raised: keep a finished recording, drop a partial one (or one this pass left)."""
        if self.state is TraceState.REPLAYING:
            self.position = 0
        else:
            self.restart()
