"""A backward through the engine's model, framed by the engine's work before and after it: ``engine.backward(loss)``,
or ``engine.backward_scope()`` around a backward the caller runs itself (one loss over several engines).

[Note: cleaning up after a backward that raised]
A backward that raised leaves the engine's hooks mid-pass, reduce-scatters in flight and part of its gradients in the
shards. The scope drops them (``ModuleHooks.abandon_backward``), tells the other ranks (``abort_pass``) and, where
nothing earlier was accumulated, empties the shards ([Note: a backward that raised] in zinf/update/accumulation.py).
The error the user sees is the backward's own. Were a step of that clean-up to raise too, its error is added to the
backward's as a note and logged, and the gradients are marked for ``zero_grad()``: ``step()`` refuses until it runs,
since nobody knows what the shards then hold.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager, Iterator

from zinf.forward_pass import ForwardPass
from zinf.report import StepTimers
from zinf.schedule.hooks import ModuleHooks
from zinf.update.accumulation import Accumulation

__all__ = ["BackwardPass"]

log = logging.getLogger("zinf")


class BackwardPass:
    """The engine's frame around one autograd backward that reaches its model: the entry point's frame, the step's
    backward timer, the stance of the forwards it differentiates (``ForwardPass.backward_stance``), and the clean-up of
    one that raised (see [Note: cleaning up after a backward that raised])."""

    def __init__(self, hooks: ModuleHooks, grads: Accumulation, timers: StepTimers, forward_pass: ForwardPass,
                 entry: Callable[[str], ContextManager[None]], zero_grad: Callable[[], None]) -> None:
        self.hooks, self.grads, self.timers, self.forward_pass = hooks, grads, timers, forward_pass
        self.entry, self.zero_grad = entry, zero_grad

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        before = self.grads.snapshot()
        with self.entry("backward"), self.timers.time("backward"), self.forward_pass.backward_stance():
            try:
                yield
            except BaseException as exc:
                self._clean_up(before, exc)
                raise

    def _clean_up(self, before: tuple[bool, int], exc: BaseException) -> None:
        failed = []
        for step in (self.hooks.abandon_backward, self.hooks.abort_pass, lambda: self._drop_partial(before)):
            try:  # each step runs even after one failed: abort_pass tells the other ranks, who would wait otherwise
                step()
            except Exception as cleanup:  # the backward's error stays the one raised
                failed.append(cleanup)
        if failed:
            self.grads.mark_unknown()
            note = (f"zinf: dropping this backward's partial gradients also raised {failed[0]!r}; step() refuses until "
                    f"zero_grad() empties the gradient shards")
            log.error("%s", note, exc_info=failed[0])
            _add_note(exc, note)

    def _drop_partial(self, before: tuple[bool, int]) -> None:
        if self.grads.backward_raised(before):  # [Note: a backward that raised] in zinf/update/accumulation.py
            self.zero_grad()


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11 on; before, the logged line alone says it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
