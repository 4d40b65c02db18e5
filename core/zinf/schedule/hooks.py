"""Every hook zinf puts on a model, registered here and kept as handles so that ``remove()`` undoes them.

Per module call (forward): pre-hook -> gather the module's groups (and its known external groups),
prefetch the next modules' groups from the trace; post-hook -> release them, and hook the outputs so
that the module's backward is announced. Per module call (backward): the first output gradient ->
gather the module's groups again and hold them until their gradients have arrived. Per parameter:
post-accumulate-grad hook -> the gradient goes into the group's flat gradient; when the group is
complete it is reduce-scattered and the group released. The end of backward flushes what is left.
See [Note: flat layout] and [Note: releasing memory] in zinf/param/flat_group.py.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zinf.config import ZeroConfig
from zinf.fetch.comm import Comm
from zinf.fetch.gather import ParamFetcher
from zinf.param.flat_group import FlatParamGroup
from zinf.param.partition import module_groups
from zinf.param.registry import group_of
from zinf.report import StepTimers
from zinf.schedule.trace import ModuleTrace
from zinf.update.reduce import GradReducer

__all__ = ["ModuleHooks"]

log = logging.getLogger(__name__)


@dataclass
class _ModuleState:
    name: str
    groups: list[FlatParamGroup]
    external: list[FlatParamGroup] = field(default_factory=list)

    def needed(self) -> list[FlatParamGroup]:
        return self.groups + [g for g in self.external if g not in self.groups]


@dataclass
class _Call:
    """One running forward call: the module and the extra groups gathered on its behalf."""

    module: nn.Module
    acquired: list[FlatParamGroup]


def _engine_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a hook body as the engine's own work: the external-parameter mode ignores what it touches."""

    @functools.wraps(method)
    def wrapper(self: "ModuleHooks", *args: Any) -> Any:
        self.busy += 1
        try:
            return method(self, *args)
        finally:
            self.busy -= 1

    return wrapper


class ModuleHooks:
    def __init__(self, model: nn.Module, config: ZeroConfig, comm: Comm, timers: StepTimers,
                 fetcher: ParamFetcher, reducer: GradReducer) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.timers = timers
        self.fetcher = fetcher
        self.reducer = reducer
        names = {m: n for n, m in model.named_modules()}
        self.states = {m: _ModuleState(names.get(m, ""), gs) for m, gs in module_groups(model).items()}
        self.traces = {"forward": ModuleTrace("forward", comm), "backward": ModuleTrace("backward", comm),
                       "eval": ModuleTrace("eval forward", comm)}
        self.stack: list[_Call] = []
        self.in_backward = False
        self.busy = 0  # > 0 while a hook body runs; see _engine_code
        self.on_backward_start: list[Callable[[], None]] = []
        self.on_backward_end: list[Callable[[], None]] = []
        self._handles: list[Any] = []
        for module in self.states:
            self._handles.append(module.register_forward_pre_hook(self._forward_pre))
            self._handles.append(module.register_forward_hook(self._forward_post))
        seen: set[int] = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- forward ------------------------------------------------------------------------------------
    def _forward_trace(self) -> ModuleTrace:
        return self.traces["forward" if torch.is_grad_enabled() else "eval"]

    @_engine_code
    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        state = self.states[module]
        trace = self._forward_trace()
        position = trace.visit(module)
        self.fetcher.acquire(state.needed(), state.name)
        self.stack.append(_Call(module, state.needed()))
        if position is not None:
            self.fetcher.prefetch(self.states[m].needed() for m in trace.order[position + 1 :])

    @_engine_code
    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self.stack.pop()
        assert call.module is module, "zinf: forward hooks out of order (a module raised mid-forward?)"
        self.fetcher.release(call.acquired)
        if torch.is_grad_enabled():
            self._announce_backward(module, output)
        if module is self.model:
            self.fetcher.sweep()
            self._forward_trace().finish_pass()

    @_engine_code
    def on_external(self, group: FlatParamGroup) -> None:
        """A parameter outside the running module's groups is used: gather it for this call (see external.py)."""
        if not self.stack:
            return  # outside a forward pass: left to GatheredParameters
        call = self.stack[-1]
        state = self.states[call.module]
        if group not in state.external:
            state.external.append(group)
            log.debug("zinf: %s uses %s from outside; gathering it with the module from now on", state.name, group.name)
        self.fetcher.acquire([group], state.name)
        call.acquired.append(group)

    # -- backward -----------------------------------------------------------------------------------
    def _announce_backward(self, module: nn.Module, output: Any) -> None:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._backward_pre(module)

        for t in tensors:
            t.register_hook(hook)

    @_engine_code
    def _backward_pre(self, module: nn.Module) -> None:
        if not self.in_backward:
            self.in_backward = True
            for fn in self.on_backward_start:
                fn()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        state = self.states[module]
        trace = self.traces["backward"]
        position = trace.visit(module)
        todo = [g for g in state.needed() if not g.backward_held]
        self.fetcher.acquire(todo, state.name)
        for g in todo:
            g.backward_held = True
        if position is not None:
            self.fetcher.prefetch(self.states[m].needed() for m in trace.order[position + 1 :])

    @_engine_code
    def _on_grad(self, param: nn.Parameter) -> None:
        group = group_of(param)
        assert group is not None and param.grad is not None
        complete = group.add_grad(param, param.grad, self.config.grad_reduce_dtype)
        param.grad = None
        if complete:
            self.reducer.reduce(group)
            self._drop_backward_hold(group)

    def _drop_backward_hold(self, group: FlatParamGroup) -> None:
        if group.backward_held:
            group.backward_held = False
            self.fetcher.release([group])

    def abandon_backward(self) -> None:
        """After a backward that raised: drop its partial gradients and holds so the next one starts clean."""
        if not self.in_backward:
            return
        for state in self.states.values():
            for g in state.needed():
                if g.has_pending_grads:
                    g.take_grad_full()
                self._drop_backward_hold(g)
        self.fetcher.sweep()
        self.in_backward = False

    @_engine_code
    def _finalize_backward(self) -> None:
        for state in self.states.values():
            for g in state.groups:
                if g.has_pending_grads:  # parameters that got no gradient this pass count as zero
                    self.reducer.reduce(g)
        self.reducer.drain()
        for state in self.states.values():
            for g in state.needed():
                self._drop_backward_hold(g)
        self.fetcher.sweep()
        self.traces["backward"].finish_pass()
        self.in_backward = False
        for fn in self.on_backward_end:
            fn()
