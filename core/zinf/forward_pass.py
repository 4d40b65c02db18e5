"""``engine(...)``: the model called between the engine's own work before and after it, work that no compiled caller
traces ([Note: compiled callers] in zinf/schedule/hooks.py)."""

from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from zinf.report import StepTimers
from zinf.schedule.external import ExternalParamMode
from zinf.schedule.hooks import ModuleHooks
from zinf.schedule.not_traced import eager_stance, not_traced
from zinf.schedule.tensors import tensors_in

__all__ = ["ForwardPass"]

_FULLGRAPH = ("the engine's own work runs outside any graph; with fullgraph=True compile the model's repeated blocks "
              "(engine.compile(regional=True, fullgraph=True)), not a module that calls the engine")


class EagerGraph(enum.Enum):
    """Whether a graph recorded by an eager forward may still be differentiated (see ``ForwardPass.backward_stance``)."""

    NONE = "none"  # no eager forward's graph since the last forward after a backward
    PENDING = "pending"  # an eager forward gave outputs with a graph: later forwards and the backward run eagerly
    DIFFERENTIATED = "differentiated"  # a backward ran since: eager until the next forward with autograd on


class ForwardPass:
    """One forward of the engine's model. ``prepare`` checks and casts the inputs; ``entry`` is the engine's frame for
    an entry point (signals held, the phase named, collectives watched); ``before`` readies the placement."""

    def __init__(self, module: nn.Module, hooks: ModuleHooks, timers: StepTimers,
                 external_mode: ExternalParamMode | None, prepare: Callable[[tuple, dict], tuple[tuple, dict]],
                 before: Callable[[bool], None], entry: Callable[[str], ContextManager[None]]) -> None:
        self.module, self.hooks, self.timers = module, hooks, timers
        self.external_mode, self.prepare, self.before, self.entry = external_mode, prepare, before, entry
        # never traced, whoever calls the engine (set here: torch.compiler imports dynamo, `import zinf` does not)
        self._enter, self._leave, self._abort, self._call_eagerly = (
            not_traced(fn, _FULLGRAPH) for fn in (self._enter_pass, self._leave_pass, self._abort_pass, self._call))
        self.eager_graph = EagerGraph.NONE

    @contextlib.contextmanager
    def backward_stance(self) -> Iterator[None]:
        """The backward of a forward that ran eagerly runs its recomputations eagerly too: a block under torch's
        non-reentrant ``checkpoint`` must save the same tensors when it runs again as it saved in the forward, and a
        compiled graph saves others than the eager modules (``CheckpointError``: "Recomputed values ... have
        different metadata"), and one that ran compiled saves the compiled graph's. So once a forward ran eagerly
        and gave outputs with a graph, the forwards after it run eagerly too until one after a backward: one loss may
        sum the outputs of the recording forward and of later ones, and its backward must recompute every one of them
        alike; a graph kept (``retain_graph=True``) may be differentiated again before the next forward."""
        with eager_stance() if self.eager_graph is not EagerGraph.NONE else contextlib.nullcontext():
            yield
        if self.eager_graph is EagerGraph.PENDING:
            self.eager_graph = EagerGraph.DIFFERENTIATED

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scope, args, kwargs, replays, eager = self._enter(args, kwargs)
        try:
            out = self.module(*args, **kwargs) if replays else self._call_eagerly(*args, **kwargs)
        except BaseException as exc:
            self._abort(scope, exc)
            raise
        self._leave(scope, out, eager)
        return out

    def _enter_pass(self, args: tuple, kwargs: dict) -> tuple[contextlib.ExitStack, tuple, dict, bool, bool]:
        args, kwargs = self.prepare(args, kwargs)
        grad = torch.is_grad_enabled()
        replays = self.hooks.replays(grad)
        if grad and self.eager_graph is EagerGraph.DIFFERENTIATED:
            self.eager_graph = EagerGraph.NONE
        # a pass that records the module order runs eagerly: see [Note: compiled modules] in zinf/schedule/hooks.py;
        # so does one whose backward may be the recording pass's (``backward_stance``)
        eager = not replays or (grad and self.eager_graph is EagerGraph.PENDING)
        stance = eager_stance() if eager else contextlib.nullcontext()
        watch = self._external_watch(replays)
        self.before(grad)
        with contextlib.ExitStack() as scope:
            for context in (self.entry("forward"), self.timers.time("forward"), watch, stance):
                scope.enter_context(context)
            return scope.pop_all(), args, kwargs, replays, eager

    def _external_watch(self, replays: bool) -> Any:
        """The external-parameter watch of the next forward: every operation while its module order is recorded,
        parameter lookups once it ``replays`` ([Note: external parameters, paid once] in zinf/schedule/external.py)."""
        if self.external_mode is None:
            return contextlib.nullcontext()
        return self.hooks.lookups.watching() if replays else self.external_mode

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _leave_pass(self, scope: contextlib.ExitStack, out: Any, eager: bool) -> None:
        scope.close()
        if eager and torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(out)):
            self.eager_graph = EagerGraph.PENDING

    def _abort_pass(self, scope: contextlib.ExitStack, exc: BaseException) -> None:
        try:
            self.hooks.unwind()  # see [Note: balanced hooks] in zinf/schedule/hooks.py
            self.hooks.abort_pass()
        finally:
            scope.__exit__(type(exc), exc, exc.__traceback__)
