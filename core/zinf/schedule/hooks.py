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
See [Note: flat layout] and [Note: releasing memory] in zinf/param/layout.py.

[Note: balanced hooks]
A forward can end without its post-hook in the ordinary sense: torch's checkpoint stops a
recomputation by raising out of it, user code raises, Ctrl-C. The post-hook is registered with
``always_call=True`` (it runs when the forward raised an ``Exception``), each call pops the stack
down to its own entry (entries above it ended by a ``BaseException``), and the engine unwinds the
whole stack when a forward pass raises. Forwards run again inside a backward (checkpoint
recomputation) gather what they need but never touch the forward trace, so the recorded order, and
the prefetch that follows it, stays that of the real forward; their gathers are recorded in the
backward trace, where they happen, so backward prefetch covers the recomputation too.

[Note: compiled modules]
A block compiled with ``torch.compile`` (``block.compile()``, ``torch.compile(block)``, the whole model) keeps its
hooks out of its graphs: the forward hooks are registered ``torch.compiler.disable``d, so dynamo breaks the graph
around them and runs them eagerly (the tensor hooks they register run in the backward, outside any graph), and the
graph reads the parameters the pre-hook gathered. A gathered parameter
is a view of its group's full buffer with the same shape and strides at every gather (only the buffer's storage is
freed and allocated again), so dynamo's guards, which check shape, stride and dtype, hold from one step to the next.
A pass that records the module order (the first, and any after the order changed) runs eagerly
(``torch.compiler.set_stance("force_eager")``, ``ZeroInfinityEngine.forward``): that is the pass in which the
external-parameter watch finds the parameters a module uses from another one, which later passes gather with it.
Inside a compiled graph the watch is not traced, so a use of another module's parameter that the recording pass
did not make reads its released placeholder (NaN, see [Note: releasing memory]); compiled code therefore compiles
from the second step on and recompiles only when a later pass records again.

[Note: compiled callers]
A caller may itself be compiled around the engine: Fabric compiles the module its strategy returns, a user may
compile a wrapper that calls ``engine(...)``. ``ZeroInfinityEngine.forward`` therefore does its own work in
``torch.compiler.disable``d calls (entering the pass with its contexts, leaving it, unwinding it after an exception),
so dynamo breaks the graph there and traces only the model call between them, as in a compiled model. A pass that
records the module order calls the model through a disabled call as well: the recording stance above applies only
to compiled code entered after it, not to a caller's frame already being compiled.

The pass the hooks are in (forward, eval forward, backward) is one :class:`~zinf.schedule.pass_state.PassState`
([Note: pass phases] in zinf/schedule/pass_state.py). Which modules are gathered as one unit, and how units are adopted
when ranks diverge: [Note: units] in zinf/schedule/units.py.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from zinf.config import ZeroConfig
from zinf.errors import UnsupportedModelError
from zinf.runtime.context import RunContext
from zinf.schedule.not_traced import HOOKS_OUTSIDE_GRAPHS, not_traced
from zinf.schedule.fetcher import ParamFetcher
from zinf.param.flat_group import FlatParamGroup
from zinf.param.partition import module_groups
from zinf.param.registry import group_of
from zinf.schedule.buffers import BufferSync
from zinf.schedule.external import ParamLookups
from zinf.schedule.keep import BackwardKeep
from zinf.schedule.module_backward import after_module_backward, announce_backward
from zinf.schedule.pass_state import (Call, ModuleState, ModuleTrace, PassState, TraceState, autograd_running,
                                      engine_code)
from zinf.schedule.rounds import Post, Rounds
from zinf.schedule.units import UnitAdoption, choose_units, make_unit
from zinf.schedule.reduce import GradReducer

__all__ = ["ModuleHooks"]

log = logging.getLogger(__name__)

_TRACE_DIVERGED = 1  # flag bit in the round that ends a pass


class ModuleHooks:
    def __init__(self, model: nn.Module, config: ZeroConfig, ctx: RunContext,
                 fetcher: ParamFetcher, reducer: GradReducer, rounds: Rounds, *,
                 on_backward_start: Sequence[Callable[[], None]] = (),
                 on_backward_end: Sequence[Callable[[], None]] = (),
                 unit_stages: Callable[[list[FlatParamGroup]], bool] = lambda groups: True, keep_room: int = 0) -> None:
        """``on_backward_start`` / ``on_backward_end``: called, in order, when a backward pass starts (before its
        first gradient lands) and after it ends (every gradient reduced). ``unit_stages``: whether the NVMe staging
        pool can read a block's groups at once (see [Note: blocks as units] in zinf/schedule/units.py).
        ``keep_room``: host bytes for groups kept from the forward to the backward (zinf/host_room.py)."""
        self.model = model
        self.config = config
        self.comm = ctx.comm
        self.timers = ctx.timers
        self.fetcher = fetcher
        self.reducer = reducer
        self.rounds = rounds
        self.groups = rounds.groups
        owned = module_groups(model)
        self.states = {module: ModuleState(name, index, owned.get(module, []))
                       for index, (name, module) in enumerate(model.named_modules())}
        self.traces = {"forward": ModuleTrace("forward"), "backward": ModuleTrace("backward"),
                       "eval": ModuleTrace("eval forward")}
        self.pass_state = PassState()  # see [Note: pass phases] in zinf/schedule/pass_state.py
        self.keep = BackwardKeep(config.overlap, self.traces["forward"], self.traces["backward"],
                                 lambda m: self.states[m].needed(), fetcher.release, keep_room)
        fetcher.use_keep(self.keep)
        self._forward_order: tuple[list[nn.Module], list[FlatParamGroup]] | None = None
        self.adoption = UnitAdoption(model, self.states, self.comm)  # see [Note: units] in zinf/schedule/units.py
        self.stack: list[Call] = []
        self.on_backward_start: tuple[Callable[[], None], ...] = tuple(on_backward_start)
        self.on_backward_end: tuple[Callable[[], None], ...] = tuple(on_backward_end)
        self.buffers = BufferSync(model, ctx, config.broadcast_buffers)
        for module in choose_units(model, config, {m: s.name for m, s in self.states.items()}, unit_stages):
            make_unit(self.states, module)
        self._handles: list[Any] = []
        # never traced by torch.compile: see [Note: compiled modules]
        pre, post, end = (not_traced(h, HOOKS_OUTSIDE_GRAPHS) for h in (self._forward_pre, self._forward_post, self._forward_end))
        for module, state in self.states.items():
            if state.inside_unit:
                continue  # the unit's hooks gather, hold and release for its whole subtree ([Note: units])
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post, always_call=True))
        self._handles.append(model.register_forward_hook(end))  # after the root's post-hook
        # parameter lookups, watched in forwards that replay their order: see [Note: external parameters, paid once]
        self.lookups = ParamLookups(self, model)
        if config.detect_external_params:
            self.lookups.install()
        seen: set[int] = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    @property
    def busy(self) -> int:
        """How many hook bodies of the engine run now (``engine_code``): the external-parameter watch ignores them."""
        return self.pass_state.busy

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
    @engine_code
    def _forward_pre(self, module: nn.Module, args: Any) -> tuple | None:
        state = self.states[module]
        recomputing = autograd_running()
        if module is self.model and not recomputing:
            self._begin_pass()
        call = Call(module, [])
        self.stack.append(call)  # first: the post-hook pops it even if gathering raises
        # a recomputation (checkpoint) runs inside backward: its gathers are part of the backward order
        trace = None if state.inside_unit else self.traces["backward"] if recomputing else self.pass_state.trace
        if trace is not None and not recomputing:
            state.called()
        position = trace.visit(module) if trace is not None else None
        if trace is self.traces["forward"]:
            call.position = position
        elif recomputing:
            call.recomputed_at = position
        needed = state.needed()
        self.fetcher.acquire(needed, state.name)
        call.acquired = list(needed)
        if position is not None:
            self.fetcher.prefetch(trace.order, position, self.keep.needed)
        if not torch.is_grad_enabled() or all(g.trainable for g in needed):
            return None
        # in a recomputation too: a reentrant checkpoint's backward runs the recomputed graph, not the forward's
        args = after_module_backward(self._after_module_backward, module, args)
        call.tracked = args is not None
        return args

    @engine_code
    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs however the forward ended (see [Note: balanced hooks]); ``output`` is None if it raised."""
        while self.stack:
            call = self.stack.pop()
            if call.module is module and output is not None:  # see [Note: kept for backward]
                kept = self.keep.after_call(call)
                call.acquired = [g for g in call.acquired if all(g is not k for k in kept)]
            self.fetcher.release(call.acquired)
            if call.module is module:
                break
        if output is not None and torch.is_grad_enabled():
            announce_backward(self._backward_pre, module, output)

    @contextlib.contextmanager
    def recompute_scope(self, module: nn.Module) -> Iterator[None]:
        """Gather ``module``'s own groups around a recomputation that bypasses its ``__call__`` (see
        zinf/recompute.py), as its pre- and post-hooks would."""
        self._forward_pre(module, ())
        try:
            yield
        finally:
            self._forward_post(module, (), None)

    @engine_code
    def _forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward returned: every rank agrees that the pass is over (serving the others' gathers
        until then), then the trace is finished and units may be adopted."""
        if not self.pass_state.in_forward or autograd_running():
            return
        post = self.pass_state.end_post
        trace = self.pass_state.end_forward()
        self.buffers.after_forward()
        flags = _TRACE_DIVERGED if trace.diverged else 0
        flags = self._sync(post, flags)
        self.fetcher.sweep()
        trace.finish_pass(bool(flags & _TRACE_DIVERGED))
        if self.rounds.active and self.config.divergence == "auto" and self.rounds.take_divergent():
            if self.adoption.adopt():  # collective: every rank is here, as the divergence was agreed on
                for t in self.traces.values():
                    t.restart()
        self.adoption.new_pass()

    def _begin_pass(self) -> None:
        if self.pass_state.in_backward:  # a backward that raised without the engine seeing it
            self.abandon_backward()
        if self.stack or self.pass_state.in_forward:  # a pass that raised without the engine seeing it
            self.unwind()
        self.keep.drop()  # a forward before this one kept groups for a backward that never came
        grad = torch.is_grad_enabled()
        if grad:
            for g in self.groups:
                changed = g.grad_in.requires_grad_changed(g.params)
                if changed is not None:
                    raise UnsupportedModelError(
                        f"zinf: requires_grad of '{changed}' changed after the engine was built; the engine keeps "
                        "gradient hooks, gradient shards and optimizer states for the parameters that train as it "
                        "was built, and a module whose parameters were all frozen keeps no fp32 master weights (only "
                        "its shards at their storage width). Freeze or unfreeze parameters before building the engine "
                        "(rebuild it to change them).")
        self.pass_state.begin_forward(self.traces["forward" if grad else "eval"], grad)
        self.buffers.before_forward()  # before the pass's first gather: see [Note: buffers like DDP]

    def unwind(self) -> None:
        """A forward pass raised: release what its calls hold and forget the pass (see [Note: balanced hooks])."""
        while self.stack:
            self.fetcher.release(self.stack.pop().acquired)
        self.keep.drop()
        trace = self.pass_state.abandon_forward()
        if trace is not None:
            trace.abort_pass()
        self.adoption.new_pass()
        self.fetcher.sweep()

    def abort_pass(self) -> None:
        """The forward or backward raised on this rank: tell the other ranks (so that none waits for this one)."""
        if self.rounds.active and not self.rounds.failed:
            self.fetcher.apply_pending_round()  # the others apply it too before they read this rank's abort
            self.rounds.abort()

    @engine_code
    def on_external(self, group: FlatParamGroup) -> None:
        """A parameter outside the running module's groups is used: gather it for this call (see external.py)."""
        if not self.stack:
            return  # outside a forward pass: left to GatheredParameters
        call = self.stack[-1]
        state = self.states[call.module]
        if state.add_external(group):
            log.debug("zinf: %s uses %s from outside; gathering it with the module from now on", state.name, group.name)
        self.fetcher.acquire([group], state.name)
        call.acquired.append(group)

    # -- backward -----------------------------------------------------------------------------------
    @engine_code
    def _backward_pre(self, module: nn.Module) -> None:
        if not self.pass_state.in_backward:
            self.pass_state.begin_backward()
            self.keep.to_backward()
            for fn in self.on_backward_start:
                fn()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        state = self.states[module]
        trace = None if state.inside_unit else self.traces["backward"]
        position = trace.visit(module) if trace is not None else None
        needed = state.needed()
        self.keep.reached(needed)
        todo = [g for g in needed if not g.backward_held]
        self.fetcher.acquire(todo, state.name)
        for g in todo:
            g.hold_for_backward()
        if position is not None:
            self.fetcher.prefetch(trace.order, position, self.keep.needed)

    @engine_code
    def _after_module_backward(self, module: nn.Module) -> None:
        """[Note: frozen groups in backward] ``module``'s backward has produced the gradients of its inputs: its
        frozen groups (no gradient will ever arrive to end their hold, see [Note: frozen groups] in
        zinf/param/master.py) are not needed any more. Without this a frozen base under LoRA adapters stayed
        gathered until the end of the backward: the whole base at once. A module whose inputs need no gradient
        (the first layer under a frozen embedding) keeps its frozen groups to the end of the backward."""
        for g in self.states[module].needed():
            if not g.trainable:
                self._drop_backward_hold(g)

    @engine_code
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
        if not self.pass_state.in_backward:
            return
        self.rounds.forget_backward()
        self.reducer.abandon(self.groups)
        for g in self.groups:
            self._drop_backward_hold(g)
        self.fetcher.sweep()
        self.pass_state.end_backward()

    @engine_code
    def _finalize_backward(self) -> None:
        for g in self.groups:
            if g.grad_in.pending:  # parameters that got no gradient this pass count as zero
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
        self.pass_state.end_backward()
        for fn in self.on_backward_end:
            fn()

    def _agree_on_used(self) -> None:
        """[Note: stepped parameters] in zinf/param/grad_flat.py: a parameter is stepped when any rank
        produced a gradient for it since the last step (DDP's meaning), so every rank steps the same ones."""
        trainable = [g for g in self.groups if g.trainable]
        if not trainable:
            return
        used = torch.cat([g.grad_in.used for g in trainable]).to(torch.int32)  # host: [Note: host-side agreement]
        self.comm.host_all_reduce(used, op="max")
        offset = 0
        for g in trainable:
            n = g.grad_in.used.numel()
            g.grad_in.used.copy_(used[offset : offset + n].bool())
            offset += n

    def _sync(self, post: Post, flags: int) -> int:
        """Take part in rounds until every rank has reached ``post``; returns every rank's flags OR-ed."""
        if not self.rounds.active:
            return flags
        self.fetcher.apply_pending_round()
        while True:
            result = self.rounds.post(post, flags=flags)
            self.fetcher.gather_union(result.gathers)
            if result.synced:
                return result.flags
