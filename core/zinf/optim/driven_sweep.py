"""An overlapped optimizer step that the training thread advances itself, as the next forward's gathers need it.

[Note: a sweep the gathers drive]
With ``offload.overlap_optimizer`` and a device that computes apart from the host (a GPU), the step's sweep runs on
a worker thread while the next forward runs ([Note: background step] in zinf/optim/offloaded.py). Where the host's
cores compute the model, that worker's CPU-Adam competes with the forward for the same cores: on a 2-core host its
Adam pass ran 2.6x slower than alone (0.12 against 0.046 s a step, a 29.5M GPT with its states on NVMe) and the
forward's matrix products waited as long. There, the sweep is driven instead: ``step()`` only starts it, and the
training thread steps sub-groups, in the sweep's order, whenever it waits for a group's update (a gather, through
the update fence's driver) or for the whole step (the backward's start, ``wait``, a checkpoint). The reads each
sub-group's step submits ahead stay in flight while the forward computes, and the writes trail behind as before.
Measured with ``benchmarks/bench_offload.py`` on that host: the NVMe step at 1.12-1.19x the in-memory one, against
1.11-1.26x with the worker thread, three rounds each.

A failure inside a driven step (an I/O error, a refused record, a Ctrl-C between two sub-groups) fails the step as
a worker's failure does: the fence raises the error to every waiter, and the optimizer's later calls raise it too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup
    from zinf.param.store import UpdateFence

__all__ = ["DrivenSweep"]


class DrivenSweep:
    """One step's sweep (``steps``: one item per sub-group stepped), advanced on the calling thread until a group's
    update is done (``until``). ``on_error`` is told of a failure before it is raised; the fence holds every group
    in ``groups`` until the sweep ends either way."""

    def __init__(self, steps: Iterator[None], fence: "UpdateFence", groups: Sequence["FlatParamGroup"],
                 on_error: Callable[[BaseException], None]) -> None:
        self._steps: Iterator[None] | None = steps
        self._fence, self._groups, self._on_error = fence, list(groups), on_error
        self._lock = threading.Lock()  # one driver at a time (a checkpoint's thread beside the training thread)

    @property
    def finished(self) -> bool:
        return self._steps is None

    def start(self) -> None:
        """Take the sweep's first item now: its first reads go out while the training thread carries on (with NVMe
        states the sweep yields once before it waits for them)."""
        self._advance()

    def until(self, group: "FlatParamGroup | None") -> None:
        """Step sub-groups until ``group``'s update is done (None: until the sweep ends)."""
        with self._lock:
            while self._steps is not None and (group is None or self._fence.pending(group)):
                self._advance_held()

    def _advance(self) -> None:
        with self._lock:
            if self._steps is not None:
                self._advance_held()

    def _advance_held(self) -> None:
        """One item of the sweep (the caller holds the lock)."""
        assert self._steps is not None
        try:
            next(self._steps)
        except StopIteration:
            self._end()
        except BaseException as exc:  # noqa: BLE001 - the step failed part way: its waiters raise it
            self._on_error(exc)
            self._end()
            raise

    def _end(self) -> None:
        self._steps = None
        self._fence.drive_by(None)
        for g in self._groups:
            self._fence.finish(g)
