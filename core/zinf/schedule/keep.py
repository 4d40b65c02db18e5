"""Which groups stay gathered from the end of their forward to their backward.

[Note: kept for backward]
ZeRO-3 gathers every parameter twice a step: for its module's forward, and again for its backward. The backward
starts where the forward ended, so the groups it gathers first are the ones the forward used last and has just
given back: the output layer, the final norm, the last blocks. Resharding them only to gather them again a few
milliseconds later costs a round and an all-gather on the backward's critical path (the backward's first module
has nothing ahead of it to hide behind). So, once both traces are known (REPLAYING: zinf/schedule/pass_state.py), the
groups the backward gathers first, in the backward's order, as many as fit ``prefetch_bytes`` (and half of
``max_gathered_bytes`` when it is set), are not resharded at their *last* use in the forward: the forward's hold
becomes the backward's (``FlatParamGroup.hold_for_backward``), the backward's pre-hook finds them gathered, and
their gradients' completion releases them as it releases any group the backward gathered. ``prefetch_bytes`` is
the memory the user already gave to parameters gathered before they are needed: kept groups fill that window
(``ParamFetcher`` counts them as gathered ahead until the backward reaches their module), so the parameters
gathered at once stay within the running module's and ``prefetch_bytes``, as without keeping (on the CPU, plus the
host's room: [Note: keeping in the host's room]). FSDP2 keeps its
root module so. The modules the backward starts with, where they are the forward's last (the output layer) or its
outermost (the root, whose call spans the forward), keep their groups whatever their size: those are gathered as
the forward ends, the backward would gather them again at once, and they are running modules at both ends, so
keeping them adds nothing to the most that is gathered at once.
A model whose parameters fit ``prefetch_bytes`` (a 4.2M GPT, 16 MiB in fp32) is gathered once a step; a Llama-7B
keeps its output layer only (250 MiB in bf16, over the window); a GPT whose head is tied to its 268 MB token
embedding keeps that embedding from the head's forward to the head's backward, one gather fewer a step.

That is ``overlap.reshard_after_forward="auto"``. "never" keeps every group the backward gathers (no budget): one
all-gather per parameter a step, for the memory of all of them gathered at the end of the forward (FSDP2's
``reshard_after_forward=False``). "always" keeps none (DeepSpeed's ZeRO-3).

[Note: keeping in the host's room]
Computing on the CPU, the gathered parameters are host memory, and a LoRA step over a frozen base spends much of
its overhead widening and moving each group twice (a 1.1B Llama on two ranks of two cores: 1.2 s a step in gathers,
0.7 s with every group kept). Where nothing else bounds the gathers (``reshard_after_forward`` "auto", no
``max_gathered_bytes``, no ``offload.max_cpu_bytes``), the engine gives keeping a room of its own beside
``prefetch_bytes``: a quarter of the host memory the placements leave free, split between the host's ranks, the
smallest over the ranks (``keep_room`` in zinf/host_room.py; ``ModuleHooks(keep_room=...)``). The groups the
backward gathers first fill it, as they fill the window; kept bytes within the room take nothing of the window, so
the forward's gathers ahead run as before; the backward then gathers (and with the parameters on NVMe reads) only
what the room could not keep. The room is measured before the first step, so it does not know the activations,
which peak when it is fullest (the forward's end); and the gather buffer cache keeps up to a quarter more than the
gathers' high-water mark mapped between steps. A run whose activations take most of the host's memory sets
``overlap.host_keep: off`` (or ``max_gathered_bytes``). On a GPU the gathers are device memory and this room is none
of theirs: there the room is 0. The step report counts the bytes each backward found kept
(``kept_for_backward_bytes``).

[Note: kept from a recomputation]
A block under activation checkpointing runs its forward again inside the backward, just before its own backward, so
gathered module by module each of its modules was gathered three times a step: for the forward, for the
recomputation, and again for its backward a few modules later (a 6-layer Llama under LoRA: 234 gathers a step against
157 without checkpointing). DeepSpeed keeps such parameters by ``stage3_max_reuse_distance``. Here the recomputation's
hold becomes the backward's (``after_call``): the groups stay gathered until the module's gradients (trained groups)
or the gradients of its inputs (frozen groups: [Note: frozen groups in backward] in zinf/schedule/hooks.py) are done,
so a recomputed block is gathered once, as a block gathered as a unit is, and at most one block's parameters stay
gathered at once besides the window ahead. Only where the recorded backward comes to the module again after its
recomputation (its own backward; so not in the first step's backward, which records the order): a module whose
output never gets a gradient, or whose backward ended before its block was recomputed, would otherwise stay gathered
to the end of the backward. Not with "always" (every group gathered again), nor under ``max_gathered_bytes``,
whose check can give back only what a forward kept.
A frozen module's end of backward is announced in the recomputation too: a reentrant checkpoint's backward runs the
recomputed graph, and without it a frozen base stayed gathered to the end of the backward (the whole model at its
peak, on the same Llama).

The decision is made from the traces, which are the same on every rank; a rank whose pass leaves its trace keeps
nothing more from there on. Where the ranks differ anyway, nothing pairs wrongly: a rank that holds a group
gathered takes part in another rank's gather of it with its own slice ([Note: rounds] in
zinf/schedule/rounds.py). What was kept and not taken by a backward (a forward without one, a second forward
first, a forward that raised) is given back before the next pass, the next step, and a load of weights into the
engine (``BackwardKeep.drop``); and first of all when a gather needs the room under ``max_gathered_bytes``
(so with that cap, "never" keeps only what fits under it).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from zinf.config_sections import OverlapConfig
from zinf.param.flat_group import FlatParamGroup
from zinf.schedule.pass_state import Call, ModuleTrace, TraceState

__all__ = ["BackwardKeep"]


class BackwardKeep:
    """Which groups to keep for the backward (for each, the forward trace position of its last use, computed once
    per pair of recorded traces), and the groups kept now: by a forward for a backward that has not taken them yet,
    and those the running backward took over and has not reached yet. ``release`` gives back a group whose last
    hold ended (``ParamFetcher.release``)."""

    def __init__(self, config: OverlapConfig, forward: ModuleTrace, backward: ModuleTrace,
                 needed: Callable[[nn.Module], Sequence[FlatParamGroup]],
                 release: Callable[[Sequence[FlatParamGroup]], None], room: int = 0) -> None:
        """``room``: bytes of host memory the engine gives to keeping beyond ``prefetch_bytes`` ([Note: keeping in
        the host's room]; ``keep_room`` in zinf/host_room.py makes it 0 wherever it does not apply)."""
        self.config = config
        self.room = room
        self.forward = forward
        self.backward = backward
        self.needed = needed
        self.release = release
        self._for: tuple[list[nn.Module], list[nn.Module]] | None = None
        self._last: dict[int, int] = {}
        self._kept: list[FlatParamGroup] = []  # kept gathered by a forward for its backward, not taken by one yet
        self._kept_taken: list[FlatParamGroup] = []  # what the running backward took over, until a module uses it
        self._again: tuple[list[nn.Module] | None, set[int]] = (None, set())  # positions used again, in that order
        self._kept_at_turn = 0  # full bytes the last backward found kept (``take_counts``)

    @property
    def kept(self) -> list[FlatParamGroup]:
        """The groups a forward kept for a backward that has not taken them yet."""
        return list(self._kept)

    def hold_for_backward(self, groups: Sequence[FlatParamGroup]) -> None:
        """A forward call's hold on ``groups`` becomes their backward's: they stay gathered, and the release that
        ends their backward ends it."""
        for g in groups:
            g.hold_for_backward()
        self._kept.extend(groups)

    def to_backward(self) -> None:
        """A backward started: what the forward kept is the backward's now (released as its gradients complete)."""
        self._kept_taken, self._kept = self._kept, []
        self._kept_at_turn += sum(g.nbytes_full for g in self._kept_taken if g.owns_full and not g.persistent)

    def take_counts(self) -> dict[str, int]:
        """``kept_for_backward_bytes``: full bytes the backwards since the last call found kept by their forwards."""
        counts, self._kept_at_turn = {"kept_for_backward_bytes": self._kept_at_turn}, 0
        return counts

    def drop(self, but: Sequence[FlatParamGroup] = ()) -> None:
        """Give back what a forward kept for a backward that has not taken it (except ``but``)."""
        kept = [g for g in self._kept if all(g is not b for b in but)]
        self._kept = [g for g in self._kept if any(g is b for b in but)]
        for g in kept:
            if g.drop_backward_hold():
                self.release([g])

    def reached(self, groups: Sequence[FlatParamGroup]) -> None:
        """The backward reached a module that uses ``groups``: kept ones among them are in use, no longer ahead."""
        if self._kept_taken:
            self._kept_taken = [g for g in self._kept_taken if all(g is not r for r in groups)]

    def kept_bytes(self) -> int:
        """Bytes kept for a backward that has not reached them yet: they fill the prefetch window as gathers ahead
        do, so that the parameters gathered at once stay within what the window allows."""
        if self.config.reshard_after_forward == "never":
            return 0  # everything is kept by request: counting it would turn the forward's prefetch off
        self._kept_taken = [g for g in self._kept_taken if g.backward_held]
        kept = sum(g.nbytes_full for g in (*self._kept, *self._kept_taken) if g.owns_full and not g.persistent)
        return max(0, kept - self.room)  # what the host's room holds is memory of its own, not the window's

    def after_call(self, call: Call) -> list[FlatParamGroup]:
        """Of the groups a forward ``call`` that returned held, the ones that stay gathered for the backward (held
        for it now): kept at their last use in a training forward, or held from a recomputation to the module's
        backward ([Note: kept from a recomputation])."""
        if call.position is not None:
            kept = self.at(call.position, call.acquired)
            self.hold_for_backward(kept)
            return kept
        at = call.recomputed_at
        if at is None or self.config.reshard_after_forward == "always" or self.config.max_gathered_bytes:
            return []
        if not self._used_again(at):
            return []  # its backward is not where the recorded backward goes next: nothing would end the hold
        kept = [g for g in call.acquired if not (g.backward_held or g.persistent) and (g.trainable or call.tracked)]
        for g in kept:
            g.hold_for_backward()
        return kept

    def _used_again(self, position: int) -> bool:
        """Whether the module at ``position`` of the recorded backward comes again later in it (its own backward,
        after its recomputation)."""
        order = self.backward.order
        if self._again[0] is not order:
            seen: set[int] = set()
            again = set()
            for p in range(len(order) - 1, -1, -1):
                if id(order[p]) in seen:
                    again.add(p)
                seen.add(id(order[p]))
            self._again = (order, again)
        return position in self._again[1]

    def at(self, position: int, groups: Sequence[FlatParamGroup]) -> list[FlatParamGroup]:
        """Of ``groups`` (held by the forward call at trace ``position``), the ones to keep gathered now."""
        last = self._plan()
        if not last:
            return []
        return [g for g in groups if last.get(id(g)) == position and not g.backward_held]

    def _plan(self) -> dict[int, int]:
        fwd, bwd = self.forward, self.backward
        if self.config.reshard_after_forward == "always":
            return {}
        if fwd.state is not TraceState.REPLAYING or bwd.state is not TraceState.REPLAYING:
            return {}
        if self._for is not None and self._for[0] is fwd.order and self._for[1] is bwd.order:
            return self._last
        everything = self.config.reshard_after_forward == "never"
        budget = self.config.prefetch_bytes + self.room
        if self.config.max_gathered_bytes:
            budget = min(budget, self.config.max_gathered_bytes // 2)
        head: set[int] = set()
        # gathered as the forward ends: its last module's groups and the outermost module's (whose call spans it)
        ends = (fwd.order[0], fwd.order[-1]) if fwd.order else ()
        leading = True
        for module in bwd.order:
            new = [g for g in self.needed(module) if id(g) not in head and not g.persistent]  # those stay anyway
            if leading and any(module is m for m in ends):
                head.update(id(g) for g in new)  # the backward starts with them: kept whatever their size
                continue
            leading = False
            size = sum(g.nbytes_full for g in new if g.owns_full)
            if not everything and size > budget:
                break
            budget -= size
            head.update(id(g) for g in new)
        last: dict[int, int] = {}
        for position, module in enumerate(fwd.order):
            for g in self.needed(module):
                if id(g) in head:
                    last[id(g)] = position
        self._for, self._last = (fwd.order, bwd.order), last
        return last
