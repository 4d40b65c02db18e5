"""What the hooks know of a pass: which pass runs (its phase), the module order it follows (its trace) and each
module's record (its groups, its unit, its forward calls).

[Note: pass phases]
A pass starts in the root's pre-hook (a forward: FORWARD with gradients enabled, EVAL without) or at the first
module whose backward is announced (BACKWARD). A forward ends in the root's forward hook (``end_forward``) or, when
it raised, in ``ModuleHooks.unwind`` (``abandon_forward``); a backward ends at its final callback, or in
``ModuleHooks.abandon_backward`` when it raised (``end_backward`` both). Forwards run again inside a backward
(checkpoint recomputation) are part of that backward: they move no phase. A backward that starts inside a forward
(``torch.autograd.grad`` in a model's ``forward``) interrupts it: the forward's trace stays the running forward's,
and the forward resumes when that backward ends. A pass that raised where the engine did not see it (a forward
called outside the engine, a ``loss.backward()`` of the user's own) is abandoned when the next forward starts.
The round that ends a forward names what kind it was (``end_post``: ``Post.END_FORWARD`` / ``Post.END_EVAL``).

[Note: module order]
The module order of one pass (forward or backward), recorded once and replayed to drive prefetch.

The first pass records; later passes compare each module against the recording. The first
mismatch marks the trace invalid and prefetching stops for the rest of the pass (gathers are issued
through rounds, so the ranks stay in step whatever each one prefetches; see [Note: rounds] in
zinf/schedule/rounds.py). At the end of the pass the ranks agree, in the round that ends the pass, on
whether any of them saw a mismatch; if so every rank records afresh.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from zinf.param.flat_group import FlatParamGroup
from zinf.schedule.rounds import Post

__all__ = ["Call", "ModuleState", "ModuleTrace", "PassPhase", "PassState", "TraceState", "autograd_running",
           "engine_code"]

log = logging.getLogger(__name__)


class PassPhase(enum.Enum):
    """IDLE: no pass runs. FORWARD: a training forward (gradients enabled) runs. EVAL: a forward without gradients
    runs. BACKWARD: a backward runs, from its first module's backward to its final callback."""

    IDLE = "idle"
    FORWARD = "forward"
    EVAL = "eval"
    BACKWARD = "backward"


_FORWARDS = (PassPhase.FORWARD, PassPhase.EVAL)


class PassState:
    """The hooks' pass: its phase (see [Note: pass phases]), the trace of the forward running now (None outside a
    forward), and ``busy``, how many hook bodies of the engine run now (``engine_code``: the external-parameter watch
    ignores what they touch)."""

    def __init__(self) -> None:
        self.phase = PassPhase.IDLE
        self.trace: ModuleTrace | None = None
        self.busy = 0
        self._resumes = PassPhase.IDLE  # what the running backward interrupted: IDLE, or a forward

    @property
    def in_forward(self) -> bool:
        """Whether a forward pass runs (or is interrupted by a backward it started)."""
        return self.trace is not None

    @property
    def in_backward(self) -> bool:
        return self.phase is PassPhase.BACKWARD

    @property
    def end_post(self) -> Post:
        """What the round that ends the running forward says."""
        assert self.phase in _FORWARDS, f"zinf: end of a forward pass in phase {self.phase}"
        return Post.END_FORWARD if self.phase is PassPhase.FORWARD else Post.END_EVAL

    # -- transitions ------------------------------------------------------------------------------
    def begin_forward(self, trace: ModuleTrace, grad: bool) -> None:
        assert self.phase is PassPhase.IDLE, f"zinf: begin_forward in phase {self.phase}"
        self.phase = PassPhase.FORWARD if grad else PassPhase.EVAL
        self.trace = trace

    def end_forward(self) -> ModuleTrace:
        """The running forward returned: its trace."""
        assert self.phase in _FORWARDS and self.trace is not None, f"zinf: end_forward in phase {self.phase}"
        trace, self.trace = self.trace, None
        self.phase = PassPhase.IDLE
        return trace

    def abandon_forward(self) -> ModuleTrace | None:
        """The running forward raised (or was left without its end): its trace, None if no forward runs. A backward it
        started runs on and ends in IDLE."""
        trace, self.trace = self.trace, None
        if self.phase in _FORWARDS:
            self.phase = PassPhase.IDLE
        elif self.phase is PassPhase.BACKWARD:
            self._resumes = PassPhase.IDLE
        return trace

    def begin_backward(self) -> None:
        assert self.phase is not PassPhase.BACKWARD, "zinf: begin_backward in a backward"
        self._resumes, self.phase = self.phase, PassPhase.BACKWARD

    def end_backward(self) -> None:
        """The running backward ended (finished, or abandoned after it raised): back to what it interrupted."""
        assert self.phase is PassPhase.BACKWARD, f"zinf: end_backward in phase {self.phase}"
        self.phase, self._resumes = self._resumes, PassPhase.IDLE

    def enter(self) -> None:
        """A hook body of the engine starts."""
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1


def engine_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook body as the engine's own work (its owner's ``pass_state`` counts it in ``busy``): the
    external-parameter watch ignores what it touches."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any) -> Any:
        state = self.pass_state
        state.enter()
        try:
            return method(self, *args)
        finally:
            state.leave()

    return wrapper


def autograd_running() -> bool:
    """Whether autograd is running a backward on this thread (a checkpointed block being recomputed)."""
    return torch._C._current_graph_task_id() != -1


# -- the module order of a pass (see [Note: module order]) ------------------------------------------------

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


# -- what the hooks know of each module -------------------------------------------------------------------

@dataclass
class ModuleState:
    name: str
    index: int  # position in model.named_modules(): the same on every rank
    groups: list[FlatParamGroup]
    external: list[FlatParamGroup] = field(default_factory=list)
    unit: list[FlatParamGroup] | None = None  # every group of the subtree, when the module is a unit
    inside_unit: bool = False
    calls: int = 0  # forward calls in the running pass (see UnitAdoption in zinf/schedule/units.py)

    def needed(self) -> list[FlatParamGroup]:
        own = self.unit if self.unit is not None else self.groups
        return own + [g for g in self.external if g not in own]

    def called(self) -> None:
        self.calls += 1

    def new_pass(self) -> None:
        self.calls = 0

    def add_external(self, group: FlatParamGroup) -> bool:
        """The module uses ``group`` from outside: gathered with it from now on. False if already known."""
        if group in self.external:
            return False
        self.external.append(group)
        return True

    def become_unit(self, groups: list[FlatParamGroup]) -> None:
        """Gathered as one unit with ``groups`` (its subtree's): see [Note: units] in zinf/schedule/units.py."""
        self.unit = groups

    def enclose(self) -> None:
        """A unit around this module gathers for it (a unit adopted around an earlier one covers that one)."""
        self.inside_unit = True
        self.unit = None


@dataclass
class Call:
    """One running forward call: the module and the groups it holds (its own and external ones)."""

    module: nn.Module
    acquired: list[FlatParamGroup]
    position: int | None = None  # in the forward trace, when replaying a training forward in step
    recomputed_at: int | None = None  # a recomputation inside a replayed backward: its position in the backward trace
    tracked: bool = False  # its backward's end is announced ([Note: frozen groups in backward])
