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
    def __init__(self, timers: StepTimers | None = None) -> None:
        self._events: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self._timers = timers or StepTimers()

    def begin(self, groups: "list[FlatParamGroup]") -> None:
        """A background step starts: every group in ``groups`` is pending until ``finish``."""
        self._events = {id(g): threading.Event() for g in groups}

    def finish(self, group: "FlatParamGroup") -> None:
        event = self._events.get(id(group))
        if event is not None:
            event.set()

    def fail(self, error: BaseException) -> None:
        """The step failed: every group stays pending for good and its waiters raise ``error``."""
        self._error = error
        for event in self._events.values():
            event.set()

    def pending(self, group: "FlatParamGroup") -> bool:
        event = self._events.get(id(group))
        return self._error is not None or (event is not None and not event.is_set())

    def wait(self, group: "FlatParamGroup") -> None:
        """Block until ``group``'s update is done (timed as ``optimizer_wait``: the step fell behind the forward);
        raise the step's error if it failed."""
        event = self._events.get(id(group))
        if event is not None and not event.is_set():
            with self._timers.time("optimizer_wait"):
                event.wait()
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        for event in list(self._events.values()):
            event.wait()
        if self._error is not None:
            raise self._error
