"""Which groups' new shards a background optimizer step has not produced yet.

A background step (zinf/optim/offloaded.py [Note: background step]) updates the groups in order while the
next forward starts; a gather of a group whose update is still running must wait for it, and a gather after a
failed step must raise that step's error instead of training on a half-updated model. The fence is built
once by the placement and handed to every group, the parameter store and the optimizer; with no background
step nothing is ever pending and every call is a dictionary lookup.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from zinf.report import StepTimers

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["UpdateFence"]


class UpdateFence:
    """The groups still pending, under one condition variable: a step begins with one set, not an event per group
    (made on the training thread between the backward and the next forward, they cost it a millisecond a step)."""

    def __init__(self, timers: StepTimers | None = None) -> None:
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._error: BaseException | None = None
        self._timers = timers or StepTimers()

    def begin(self, groups: "list[FlatParamGroup]") -> None:
        """A background step starts: every group in ``groups`` is pending until ``finish``."""
        with self._cond:
            self._pending = {id(g) for g in groups}

    def finish(self, group: "FlatParamGroup") -> None:
        with self._cond:
            if id(group) in self._pending:
                self._pending.discard(id(group))
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The step failed: every group stays pending for good and its waiters raise ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def pending(self, group: "FlatParamGroup") -> bool:
        return self._error is not None or id(group) in self._pending

    def wait(self, group: "FlatParamGroup") -> None:
        """Block until ``group``'s update is done (timed as ``optimizer_wait``: the step fell behind the forward);
        raise the step's error if it failed."""
        if id(group) in self._pending and self._error is None:
            with self._timers.time("optimizer_wait"), self._cond:
                self._cond.wait_for(lambda: id(group) not in self._pending or self._error is not None)
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._pending or self._error is not None)
