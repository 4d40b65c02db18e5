"""Which groups stay gathered from the end of their forward to their backward.

[Note: kept for backward]
ZeRO-3 gathers every parameter twice a step: for its module's forward, and again for its backward. The backward
starts where the forward ended, so the groups it gathers first are the ones the forward used last and has just
given back: the output layer, the final norm, the last blocks. Resharding them only to gather them again a few
milliseconds later costs a round and an all-gather on the backward's critical path (the backward's first module
has nothing ahead of it to hide behind). So, once both traces are known (REPLAYING: zinf/schedule/trace.py), the
groups the backward gathers first, in the backward's order, as many as fit ``prefetch_bytes`` (and half of
``max_gathered_bytes`` when it is set), are not resharded at their *last* use in the forward: the forward's hold
becomes the backward's (``FlatParamGroup.hold_for_backward``), the backward's pre-hook finds them gathered, and
their gradients' completion releases them as it releases any group the backward gathered. ``prefetch_bytes`` is
the memory the user already gave to parameters gathered before they are needed: kept groups fill that window
(``ParamFetcher`` counts them as gathered ahead until the backward reaches their module), so the parameters
gathered at once stay within the running module's and ``prefetch_bytes``, as without keeping. FSDP2 keeps its
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

The decision is made from the traces, which are the same on every rank; a rank whose pass leaves its trace keeps
nothing more from there on. Where the ranks differ anyway, nothing pairs wrongly: a rank that holds a group
gathered takes part in another rank's gather of it with its own slice ([Note: rounds] in
zinf/schedule/rounds.py). What was kept and not taken by a backward (a forward without one, a second forward
first, a forward that raised) is given back before the next pass, the next step, and a load of weights into the
engine (``ParamFetcher.drop_kept``); and first of all when a gather needs the room under ``max_gathered_bytes``
(so with that cap, "never" keeps only what fits under it).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from zinf.config import OverlapConfig
from zinf.param.flat_group import FlatParamGroup
from zinf.schedule.trace import ModuleTrace, TraceState

__all__ = ["BackwardKeep"]


class BackwardKeep:
    """For each group kept for the backward, the forward trace position of its last use (computed once per pair
    of recorded traces)."""

    def __init__(self, config: OverlapConfig, forward: ModuleTrace, backward: ModuleTrace,
                 needed: Callable[[nn.Module], Sequence[FlatParamGroup]]) -> None:
        self.config = config
        self.forward = forward
        self.backward = backward
        self.needed = needed
        self._for: tuple[list[nn.Module], list[nn.Module]] | None = None
        self._last: dict[int, int] = {}

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
        budget = self.config.prefetch_bytes
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
