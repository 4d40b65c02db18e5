"""The CPU-Adam of each group started during the backward, as soon as its gradient shard is complete.

[Note: steps during the backward]
With ``offload.step_during_backward`` (optimizer states in host memory), a group whose gradient shard is complete
in the backward (the reducer's ``on_complete``) is stepped at once on a worker thread (the C++ Adam releases the
GIL), with what the step after the backward is predicted to use: the gradient factor of the last step taken
(1 when it did not clip; none is predicted after a step that clipped, which would clip again), the parameters
this rank produced gradients for, their step counts plus one, the hyper-parameters as they are now, and only in
the backward the step count predicts to be the last before the step (gradient accumulation). Before it steps a
sub-group it copies its master and moments aside (the rollback copies: 12 bytes per parameter, kept). It writes
the master and moments only: the parameter shard and the gradient's zeroing wait for the step.

The step after the backward takes, for each sub-group stepped early, exactly what the step would have used (the
factor from the pending unscale and clip, the parameters any rank stepped, the counts, the hyper-parameters, the
gradient's version: it changes when a later micro-batch or re-entrant backward adds to it) and compares: equal,
the early step *is* the step (the same C++ call on the same inputs), and only the parameter shard is written from
the master and the gradient zeroed; different, the master and moments are copied back and the sub-group stepped
as usual. A skipped step (an fp16 overflow) or a ``zero_grad`` rolls every early step back. So the result equals
the step after the backward bit for bit in every case; what a misprediction costs is the early step, the copy
back, and the copies aside (with clipping active every step only the first step is predicted, then none).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zinf import native
from zinf.native import AdamHyper
from zinf.optim.fused_step import moment_rounding
from zinf.offload.subgroups import SubGroup
from zinf.report import StepTimers

if TYPE_CHECKING:
    from zinf.offload.state_store import CpuStateStore
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["EarlySteps", "EarlyInputs", "hyper_key"]


def hyper_key(hyper: list[AdamHyper]) -> tuple[tuple[float, ...], ...]:
    return tuple((h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, float(h.decoupled)) for h in hyper)


@dataclass(frozen=True)
class EarlyInputs:
    """What one group's step uses: the gradient factor, which slots it steps, their step counts, the
    hyper-parameters and the gradient shard's version."""

    factor: float
    stepped: tuple[bool, ...]
    steps: tuple[int | None, ...]
    hyper: tuple[tuple[float, ...], ...]
    version: int


class EarlySteps:
    def __init__(self, states: "CpuStateStore", timers: StepTimers) -> None:
        self.states, self.timers = states, timers
        self._backups: dict[int, dict[str, torch.Tensor]] = {}  # sub-group -> its rollback copies (kept)
        self._taken: dict[int, EarlyInputs] = {}  # group -> the inputs of its early step
        self._pending: list[Future[None]] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-early-adam")
        self._lock = threading.Lock()
        self.num_kept = self.num_redone = 0  # sub-groups whose early step was the step / was rolled back

    def start(self, group: "FlatParamGroup", inputs: EarlyInputs, hyper: list[AdamHyper]) -> None:
        """Step ``group``'s sub-groups on the worker with ``inputs`` (called on the training thread)."""
        with self._lock:
            self._taken[id(group)] = inputs
        self._pending.append(self._pool.submit(self._step_group, group, inputs, hyper))

    def started(self, group: "FlatParamGroup") -> bool:
        with self._lock:
            return id(group) in self._taken

    def join(self) -> None:
        """Wait for every early step issued; raise the first error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def take(self, group: "FlatParamGroup") -> EarlyInputs | None:
        """The inputs ``group`` was stepped early with (once), after ``join``."""
        with self._lock:
            return self._taken.pop(id(group), None)

    def keep(self, sg: SubGroup) -> None:
        """``sg``'s early step is the step."""
        self.num_kept += 1

    def roll_back(self, sg: SubGroup) -> None:
        """Put ``sg``'s master and moments back as they were before its early step."""
        self.num_redone += 1
        states = self.states.states_of(sg)
        backup = self._backups[id(sg)]
        for name in self.states.layout.names:
            states[name].copy_(backup[name])

    def roll_back_all(self) -> None:
        """Undo every early step (the step after the backward was skipped, or the gradients dropped)."""
        self.join()
        with self._lock:
            taken, self._taken = self._taken, {}
        for sg in self.states.subgroups:
            if id(sg.group) in taken:
                self.roll_back(sg)

    def close(self) -> None:
        self.join()
        self._pool.shutdown(wait=True)

    def _step_group(self, group: "FlatParamGroup", inputs: EarlyInputs, hyper: list[AdamHyper]) -> None:
        with self.timers.time("adam_early"):
            self._step_subgroups(group, inputs, hyper)

    def _step_subgroups(self, group: "FlatParamGroup", inputs: EarlyInputs, hyper: list[AdamHyper]) -> None:
        grad = group.grad.resident  # landed here, off the training thread
        assert grad is not None
        for sg in self.states.of(group):
            states = self.states.states_of(sg)
            backup = self._backups.get(id(sg))
            if backup is None:
                backup = self._backups[id(sg)] = {n: torch.empty_like(states[n]) for n in self.states.layout.names}
            for name in self.states.layout.names:
                backup[name].copy_(states[name])
            master, m, v, g = states["master"], states["exp_avg"], states["exp_avg_sq"], grad[sg.lo : sg.hi]
            for j, (lo, hi, k, i) in enumerate(sg.segments):
                if not inputs.stepped[i]:
                    continue
                a, b = lo - sg.lo, hi - sg.lo
                step = inputs.steps[i]
                assert step is not None
                native.adam_step(master[a:b], g[a:b], m[a:b], v[a:b], hyper[k], step=step, clip_coef=inputs.factor,
                                 **moment_rounding(sg, a, step), **self.states.layout.segment_scales(sg, states, j))
