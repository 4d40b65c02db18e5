"""Every hook zinf puts on a model, registered here and kept as handles so that ``remove()`` undoes them.

Per pass: the root's pre-hook first gives every rank rank 0's buffers when DDP would (see [Note: buffers
like DDP] in zinf/schedule/buffers.py). Per module call (forward): pre-hook -> gather the module's groups
(and its known external groups), prefetch the next modules' groups from the trace; post-hook -> release
them (but those the backward gathers first stay gathered into it: [Note: kept for backward] in
zinf/schedule/keep.py), and hook the outputs so that the module's backward is announced. Per module call
(backward): the first output gradient -> gather the module's groups again (unless kept) and hold them until
their gradients have arrived.
Per parameter: post-accumulate-grad hook -> the gradient goes into the group's flat gradient; when the group
is complete it is reduce-scattered (with several ranks: once every rank agreed, see [Note: rounds] in
zinf/schedule/rounds.py) and the group released. The end of backward flushes what is left.
See [Note: flat layout] and [Note: releasing memory] in zinf/param/flat_group.py.

[Note: balanced hooks]
A forward can end without its post-hook in the ordinary sense: torch's checkpoint stops a
recomputation by raising out of it, user code raises, Ctrl-C. The post-hook is registered with
``always_call=True`` (it runs when the forward raised an ``Exception``), each call pops the stack
down to its own entry (entries above it ended by a ``BaseException``), and the engine unwinds the
whole stack when a forward pass raises. Forwards run again inside a backward (checkpoint
recomputation) gather what they need but never touch the forward trace, so the recorded order, and
the prefetch that follows it, stays that of the real forward; their gathers are recorded in the
backward trace, where they happen, so backward prefetch covers the recomputation too.

[Note: units]
A module listed in ``unit_modules`` (or adopted by ``divergence="auto"``) is gathered as one unit: its
pre-hook (and its backward) gathers every group of its subtree at once, so whichever submodules run
inside it (mixture-of-experts routing), every rank issues the same gathers. Modules inside a unit are
left out of the traces: the order inside a unit may change from step to step without invalidating
prefetch. Units chosen when the engine is built (``unit_modules``, and the model's blocks with
``unit_policy="blocks"``: [Note: blocks as units] in zinf/schedule/units.py) carry the only hooks of their
subtree: the modules inside have none, so a block costs one pre-hook, one post-hook and one backward
announcement, not one per module. A parameter a module inside uses from outside the unit is gathered with
the unit (``on_external`` sees the unit as the running module). With ``divergence="auto"``, when ranks
disagreed on gathers during a forward pass, the ranks compare which modules each called; for each module
called on some ranks only, its nearest ancestor that every rank called (the same number of times) becomes
a unit, logged, from the next pass on. The root never becomes a unit (that would gather the whole model):
such divergence stays served round by round, which is exact too.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from zinf.config import ZeroConfig
from zinf.errors import UnsupportedModelError
from zinf.runtime.comm import Comm
from zinf.schedule.fetcher import ParamFetcher
from zinf.param.flat_group import FlatParamGroup
from zinf.param.partition import module_groups
from zinf.param.registry import group_of, groups_of
from zinf.report import StepTimers
from zinf.schedule.buffers import BufferSync
from zinf.schedule.external import ParamLookups
from zinf.schedule.keep import BackwardKeep
from zinf.schedule.rounds import Post, Rounds
from zinf.schedule.tensors import tensors_in
from zinf.schedule.trace import ModuleTrace, TraceState
from zinf.schedule.units import choose_units, is_called
from zinf.schedule.reduce import GradReducer

__all__ = ["ModuleHooks"]

log = logging.getLogger(__name__)

_TRACE_DIVERGED = 1  # flag bit in the round that ends a pass


@dataclass
class _ModuleState:
    name: str
    index: int  # position in model.named_modules(): the same on every rank
    groups: list[FlatParamGroup]
    external: list[FlatParamGroup] = field(default_factory=list)
    unit: list[FlatParamGroup] | None = None  # every group of the subtree, when the module is a unit
    inside_unit: bool = False

    def needed(self) -> list[FlatParamGroup]:
        own = self.unit if self.unit is not None else self.groups
        return own + [g for g in self.external if g not in own]


@dataclass
class _Call:
    """One running forward call: the module and the groups it holds (its own and external ones)."""

    module: nn.Module
    acquired: list[FlatParamGroup]
    position: int | None = None  # in the forward trace, when replaying a training forward in step


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


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpointed block being recomputed)."""
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward tells the hooks that the module's backward is done (the
    gradients of its inputs exist): see [Note: frozen groups in backward]."""

    @staticmethod
    def forward(ctx: Any, hooks: "ModuleHooks", module: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks, ctx.module = hooks, module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.hooks._post_backward(ctx.module)
        return (None, None, *grads)


def _after_backward(hooks: "ModuleHooks", module: nn.Module, args: tuple) -> tuple | None:
    """``args`` with the tensors that need a gradient passed through :class:`_PostBackward` (None: none do)."""
    picked = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not picked:
        return None
    out = list(args)
    for i, t in zip(picked, _PostBackward.apply(hooks, module, *(args[i] for i in picked))):
        out[i] = t
    return tuple(out)


class ModuleHooks:
    def __init__(self, model: nn.Module, config: ZeroConfig, comm: Comm, timers: StepTimers,
                 fetcher: ParamFetcher, reducer: GradReducer, rounds: Rounds, *,
                 on_backward_start: Sequence[Callable[[], None]] = (),
                 on_backward_end: Sequence[Callable[[], None]] = (),
                 unit_stages: Callable[[list[FlatParamGroup]], bool] = lambda groups: True) -> None:
        """``on_backward_start`` / ``on_backward_end``: called, in order, when a backward pass starts (before its
        first gradient lands) and after it ends (every gradient reduced). ``unit_stages``: whether the NVMe staging
        pool can read a block's groups at once (see [Note: blocks as units] in zinf/schedule/units.py)."""
        self.model = model
        self.config = config
        self.comm = comm
        self.timers = timers
        self.fetcher = fetcher
        self.reducer = reducer
        self.rounds = rounds
        self.groups = rounds.groups
        owned = module_groups(model)
        self.states: dict[nn.Module, _ModuleState] = {}
        self.parent: dict[nn.Module, nn.Module] = {}
        for index, (name, module) in enumerate(model.named_modules()):
            self.states[module] = _ModuleState(name, index, owned.get(module, []))
            for child in module.children():
                self.parent.setdefault(child, module)
        self.traces = {"forward": ModuleTrace("forward"), "backward": ModuleTrace("backward"),
                       "eval": ModuleTrace("eval forward")}
        self.pass_trace: ModuleTrace | None = None  # the trace of the forward pass running now
        self.keep = BackwardKeep(config.overlap, self.traces["forward"], self.traces["backward"],
                                 lambda m: self.states[m].needed())
        self._forward_order: tuple[list[nn.Module], list[FlatParamGroup]] | None = None
        self._pass_post = Post.END_FORWARD
        self._calls = [0] * len(self.states)  # forward calls per module in this pass (see [Note: units])
        self._refused_units: set[str] = set()
        self.stack: list[_Call] = []
        self.in_backward = False
        self.busy = 0  # > 0 while a hook body runs; see _engine_code
        self.on_backward_start: tuple[Callable[[], None], ...] = tuple(on_backward_start)
        self.on_backward_end: tuple[Callable[[], None], ...] = tuple(on_backward_end)
        self.buffers = BufferSync(model, comm, timers, config.broadcast_buffers)
        for module in choose_units(model, config, {m: s.name for m, s in self.states.items()}, unit_stages):
            self._make_unit(module)
        self._handles: list[Any] = []
        for module, state in self.states.items():
            if state.inside_unit:
                continue  # the unit's hooks gather, hold and release for its whole subtree: see [Note: units]
            self._handles.append(module.register_forward_pre_hook(self._forward_pre))
            self._handles.append(module.register_forward_hook(self._forward_post, always_call=True))
        self._handles.append(model.register_forward_hook(self._forward_end))  # after the root's post-hook
        # parameter lookups, watched in forwards that replay their order: see [Note: external parameters, paid once]
        self.lookups = ParamLookups(self, model)
        if config.detect_external_params:
            self.lookups.install()
        seen: set[int] = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.lookups.remove()

    def replays(self, grad: bool) -> bool:
        """Whether the next forward pass (training with ``grad``, else eval) replays a recorded module order."""
        return self.traces["forward" if grad else "eval"].state is TraceState.REPLAYING

    def forward_order(self) -> list[FlatParamGroup] | None:
        """The groups in the order the recorded training forward first gathers them (its modules' own and external
        groups); None until that order replays. The same list while the recorded order is."""
        trace = self.traces["forward"]
        if trace.state is not TraceState.REPLAYING:
            return None
        if self._forward_order is None or self._forward_order[0] is not trace.order:
            seen: dict[int, FlatParamGroup] = {}
            for module in trace.order:
                for g in self.states[module].needed():
                    seen.setdefault(id(g), g)
            self._forward_order = (trace.order, list(seen.values()))
        return self._forward_order[1]

    @property
    def units(self) -> list[str]:
        """The names of the modules gathered as one unit (configured and adopted)."""
        return [s.name for s in self.states.values() if s.unit is not None]

    # -- forward ------------------------------------------------------------------------------------
    @_engine_code
    def _forward_pre(self, module: nn.Module, args: Any) -> tuple | None:
        state = self.states[module]
        recomputing = _in_backward()
        if module is self.model and not recomputing:
            self._begin_pass()
        call = _Call(module, [])
        self.stack.append(call)  # first: the post-hook pops it even if gathering raises
        # a recomputation (checkpoint) runs inside backward: its gathers are part of the backward order
        trace = None if state.inside_unit else self.traces["backward"] if recomputing else self.pass_trace
        if trace is not None and not recomputing:
            self._calls[state.index] += 1
        position = trace.visit(module) if trace is not None else None
        if trace is self.traces["forward"]:
            call.position = position
        needed = state.needed()
        self.fetcher.acquire(needed, state.name)
        call.acquired = list(needed)
        if position is not None:
            self.fetcher.prefetch(self.states[m].needed() for m in trace.order[position + 1 :])
        if not recomputing and torch.is_grad_enabled() and any(not g.trainable for g in needed):
            return _after_backward(self, module, args)
        return None

    @_engine_code
    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs however the forward ended (see [Note: balanced hooks]); ``output`` is None if it raised."""
        while self.stack:
            call = self.stack.pop()
            if call.module is module and call.position is not None and output is not None:
                kept = self.keep.at(call.position, call.acquired)  # see [Note: kept for backward]
                if kept:
                    self.fetcher.keep(kept)
                    call.acquired = [g for g in call.acquired if all(g is not k for k in kept)]
            self.fetcher.release(call.acquired)
            if call.module is module:
                break
        if output is not None and torch.is_grad_enabled():
            self._announce_backward(module, output)

    @contextlib.contextmanager
    def recompute_scope(self, module: nn.Module) -> Iterator[None]:
        """Gather ``module``'s own groups around a recomputation that bypasses its ``__call__`` (see
        zinf/recompute.py), as its pre- and post-hooks would."""
        self._forward_pre(module, ())
        try:
            yield
        finally:
            self._forward_post(module, (), None)

    @_engine_code
    def _forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned: every rank agrees that the pass is over (serving the others' gathers
        until then), then the trace is finished and units may be adopted."""
        trace = self.pass_trace
        if trace is None or _in_backward():
            return
        self.pass_trace = None
        self.buffers.after_forward()
        flags = _TRACE_DIVERGED if trace.diverged else 0
        flags = self._sync(self._pass_post, flags)
        self.fetcher.sweep()
        trace.finish_pass(bool(flags & _TRACE_DIVERGED))
        if self.rounds.active and self.config.divergence == "auto":
            self._adopt_units()
        self._calls = [0] * len(self._calls)

    def _begin_pass(self) -> None:
        if self.stack or self.pass_trace is not None:  # a pass that raised without the engine seeing it
            self.unwind()
        self.fetcher.drop_kept()  # a forward before this one kept groups for a backward that never came
        grad = torch.is_grad_enabled()
        if grad:
            for g in self.groups:
                changed = g.requires_grad_changed()
                if changed is not None:
                    raise UnsupportedModelError(
                        f"zinf: requires_grad of '{changed}' changed after the engine was built; the engine keeps "
                        "gradient hooks, gradient shards and optimizer states for the parameters that train as it "
                        "was built, and a module whose parameters were all frozen keeps no fp32 master weights (only "
                        "its shards at their storage width). Freeze or unfreeze parameters before building the engine "
                        "(rebuild it to change them).")
        self.pass_trace = self.traces["forward" if grad else "eval"]
        self._pass_post = Post.END_FORWARD if grad else Post.END_EVAL
        self.buffers.before_forward()  # before the pass's first gather: see [Note: buffers like DDP]

    def unwind(self) -> None:
        """A forward pass raised: release what its calls hold and forget the pass (see [Note: balanced hooks])."""
        while self.stack:
            self.fetcher.release(self.stack.pop().acquired)
        self.fetcher.drop_kept()
        if self.pass_trace is not None:
            self.pass_trace.abort_pass()
            self.pass_trace = None
        self._calls = [0] * len(self._calls)
        self.fetcher.sweep()

    def abort_pass(self) -> None:
        """The forward or backward raised on this rank: tell the other ranks (so that none waits for this one)."""
        if self.rounds.active and not self.rounds.failed:
            self.fetcher.settle()  # the others apply it too before they read this rank's abort
            self.rounds.abort()

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

    # -- units (see [Note: units]) ------------------------------------------------------------------
    def _make_unit(self, module: nn.Module) -> None:
        state = self.states[module]
        state.unit = groups_of(module.parameters())
        for sub in module.modules():
            if sub is not module:
                self.states[sub].inside_unit = True
                self.states[sub].unit = None  # a unit adopted around an earlier one covers it

    def _adopt_units(self) -> None:
        if not self.rounds.take_divergent():  # ranks agreed on every gather of the pass
            return
        counts = torch.tensor(self._calls, dtype=torch.int64)  # host: see [Note: host-side agreement]
        low, high = counts.clone(), counts.clone()
        self.comm.host_all_reduce(low, op="min")
        self.comm.host_all_reduce(high, op="max")
        varies = {m for m, s in self.states.items() if int(low[s.index]) != int(high[s.index])}
        adopted: dict[nn.Module, list[str]] = {}
        for start in varies:
            if not self.states[start].groups and self.states[start].unit is None:
                continue  # neither holds parameters nor gathers a subtree
            module: nn.Module | None = start
            while module is not None and (module in varies or not is_called(module)
                                          or int(high[self.states[module].index]) == 0):
                module = self.parent.get(module)
            if module is None or module is self.model:
                name = self.states[start].name
                if name not in self._refused_units:
                    self._refused_units.add(name)
                    log.info("zinf: %s runs on some ranks only and the nearest module every rank calls is the root, "
                             "which is not gathered as one unit: its gathers stay agreed round by round (exact, one "
                             "small exchange each)", name)
                continue
            state = self.states[module]
            if state.unit is None and not state.inside_unit:
                adopted.setdefault(module, []).append(self.states[start].name)
        for module in sorted(adopted, key=lambda m: self.states[m].index):
            if self.states[module].inside_unit:  # an ancestor adopted in this same pass covers it
                continue
            self._make_unit(module)
            log.info("zinf: %s (%s) runs different submodules on different ranks (%s); gathering and reducing it "
                     "as one unit from now on (set unit_modules to choose units yourself)",
                     self.states[module].name, type(module).__name__, ", ".join(sorted(adopted[module])[:4]))
        if adopted:
            for t in self.traces.values():
                t.restart()

    # -- backward -----------------------------------------------------------------------------------
    def _announce_backward(self, module: nn.Module, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
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
            self.fetcher.kept_to_backward()
            for fn in self.on_backward_start:
                fn()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        state = self.states[module]
        trace = None if state.inside_unit else self.traces["backward"]
        position = trace.visit(module) if trace is not None else None
        needed = state.needed()
        self.fetcher.reached(needed)
        todo = [g for g in needed if not g.backward_held]
        self.fetcher.acquire(todo, state.name)
        for g in todo:
            g.hold_for_backward()
        if position is not None:
            self.fetcher.prefetch(self.states[m].needed() for m in trace.order[position + 1 :])

    @_engine_code
    def _post_backward(self, module: nn.Module) -> None:
        """[Note: frozen groups in backward] ``module``'s backward has produced the gradients of its inputs: its
        frozen groups (no gradient will ever arrive to end their hold, see [Note: frozen groups] in
        zinf/param/flat_group.py) are not needed any more. Without this a frozen base under LoRA adapters stayed
        gathered until the end of the backward: the whole base at once. A module whose inputs need no gradient
        (the first layer under a frozen embedding) keeps its frozen groups to the end of the backward."""
        for g in self.states[module].needed():
            if not g.trainable:
                self._drop_backward_hold(g)

    @_engine_code
    def _on_grad(self, param: nn.Parameter) -> None:
        group = group_of(param)
        assert group is not None and param.grad is not None
        complete = self.reducer.accumulate(group, param, param.grad, self.config.grad_reduce_dtype)
        param.grad = None
        if complete:
            self._grads_complete(group)
            self._drop_backward_hold(group)

    def _grads_complete(self, group: FlatParamGroup) -> None:
        if self.rounds.active:
            self.rounds.ready(group)  # reduce-scattered once every rank has announced it
        else:
            self.reducer.reduce(group)

    def _drop_backward_hold(self, group: FlatParamGroup) -> None:
        if group.drop_backward_hold():
            self.fetcher.release([group])

    def abandon_backward(self) -> None:
        """After a backward that raised: drop its partial gradients and holds so the next one starts clean."""
        if not self.in_backward:
            return
        self.rounds.forget_backward()
        for g in self.groups:
            if g.has_pending_grads:
                self.reducer.forget(g)
            self._drop_backward_hold(g)
        self.fetcher.sweep()
        self.in_backward = False

    @_engine_code
    def _finalize_backward(self) -> None:
        for g in self.groups:
            if g.has_pending_grads:  # parameters that got no gradient this pass count as zero
                self._grads_complete(g)
        trace = self.traces["backward"]
        flags = self._sync(Post.END_BACKWARD, _TRACE_DIVERGED if trace.diverged else 0)
        self.reducer.drain()
        if self.rounds.active:
            self._agree_on_used()
        for g in self.groups:
            self._drop_backward_hold(g)
        self.fetcher.sweep()
        trace.finish_pass(bool(flags & _TRACE_DIVERGED))
        self.in_backward = False
        for fn in self.on_backward_end:
            fn()

    def _agree_on_used(self) -> None:
        """[Note: stepped parameters] in zinf/param/flat_group.py: a parameter is stepped when any rank
        produced a gradient for it since the last step (DDP's meaning), so every rank steps the same ones."""
        trainable = [g for g in self.groups if g.trainable]
        if not trainable:
            return
        used = torch.cat([g.grad_used for g in trainable]).to(torch.int32)  # host: [Note: host-side agreement]
        self.comm.host_all_reduce(used, op="max")
        offset = 0
        for g in trainable:
            n = g.grad_used.numel()
            g.grad_used.copy_(used[offset : offset + n].bool())
            offset += n

    def _sync(self, post: Post, flags: int) -> int:
        """Take part in rounds until every rank has reached ``post``; returns every rank's flags OR-ed."""
        if not self.rounds.active:
            return flags
        self.fetcher.settle()
        while True:
            result = self.rounds.post(post, flags=flags)
            self.fetcher.gather_union(result.gathers)
            if result.synced:
                return result.flags
