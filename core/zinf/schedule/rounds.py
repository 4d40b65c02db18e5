"""Rounds: how several ranks agree on every collective issued during a forward or backward pass.

[Note: rounds]
Inside a pass, each rank's control flow may differ (mixture-of-experts routing, a layer skipped on
one rank, a checkpointed block recomputed): if each rank issued the all-gathers its own modules
need, the collectives would pair different groups across ranks, silently or with an abort deep in
the backend. So no rank issues a pass's gather or reduce-scatter on its own. Whenever a rank needs
groups gathered (a module's pre-hook, a prefetch), or reaches the end of a pass, it posts a small
message, and every rank's messages are exchanged by one all-gather of fixed size (a *round*).
Rounds only ever pair with rounds, because zinf issues nothing else inside a pass (its buffer broadcast
comes before the pass's first round: [Note: buffers like DDP] in zinf/schedule/buffers.py); a model's own
collectives (SyncBatchNorm's on a GPU) pair because every rank issues them at the same point of the same
control flow, which they need anyway. After a round every rank knows what every other rank asked for, and
does the same thing next:

- it starts the gathers of every group any rank asked for, in rank order (a rank that did not ask
  takes part with its own shard; what it gathered for others is released at the end of the pass);
- it reduce-scatters, in group order, the groups whose gradients every rank has announced as
  complete; at the end of a backward, every group any rank has a gradient for (ranks without one
  add zeros), which is what DDP does for a parameter used on some ranks only;
- a rank that reached the end of a pass keeps taking part in rounds until every rank has reached it.

Requests carry group ids (the engine's group order, the same on every rank), so a disagreement is
seen before any collective, never paired silently. ``divergence="error"`` turns a disagreement about
gathers into a :class:`~zinf.errors.CollectiveMismatchError` raised on every rank at the same round
(no hang); ``"auto"`` serves it and reports the groups involved (``take_divergent``), so that the
hooks can gather their owner's parent as one unit from then on.

With one rank there is nothing to agree on: no round is ever run.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from zinf.errors import CollectiveMismatchError, ZinfError
from zinf.runtime.context import RunContext
from zinf.param.flat_group import FlatParamGroup
from zinf.schedule.reduce import GradReducer

__all__ = ["Post", "Rounds", "RoundResult"]

log = logging.getLogger(__name__)

_SLOTS = 128  # group ids per message; more are sent over further rounds
_HEADER = 5  # post, flags, number of gather ids, number of ready ids, more to come


class Post(enum.IntEnum):
    """What a rank says in a round: it needs gathers now (WORK), it reached the end of a pass (END_*),
    or its pass raised and every rank must stop (ABORT)."""

    WORK = 0
    END_FORWARD = 1
    END_EVAL = 2
    END_BACKWARD = 3
    ABORT = 4


@dataclass
class RoundResult:
    """The gathers every rank starts now (same list, same order on every rank), whether every rank is at
    the end of the pass it named, and the OR of every rank's flags."""

    gathers: list[FlatParamGroup] = field(default_factory=list)
    synced: bool = False
    flags: int = 0


class Rounds:
    def __init__(self, ctx: RunContext, groups: Sequence[FlatParamGroup], reducer: GradReducer,
                 reduce_dtype: torch.dtype, strict: bool) -> None:
        self.comm = ctx.comm
        self.groups = list(groups)
        self.reducer = reducer
        self.timers = ctx.timers
        self.reduce_dtype = reduce_dtype
        self.strict = strict
        self._id = {id(g): i for i, g in enumerate(self.groups)}
        self._ready_local: list[int] = []  # announced complete here, not yet posted
        self._ready_from: dict[int, set[int]] = {}  # group id -> ranks that announced it complete
        self._divergent: set[int] = set()
        self.num_divergent_rounds = 0
        self._pending: tuple[torch.Tensor, Any, str, list[FlatParamGroup]] | None = None  # see post_deferred
        self.failed = False  # a round raised on every rank alike: nothing is left to tell the others

    @property
    def active(self) -> bool:
        return self.comm.world > 1

    def ready(self, group: FlatParamGroup) -> None:
        """This rank's gradients of ``group`` are complete for now: announce it in the next round."""
        if group.grad_in.report_ready():
            self._ready_local.append(self._id[id(group)])

    def forget_backward(self) -> None:
        """A backward raised: its gradient announcements are void."""
        self._ready_local, self._ready_from = [], {}

    def take_divergent(self) -> list[FlatParamGroup]:
        """The groups some ranks gathered and others did not since the last call (same on every rank)."""
        out, self._divergent = sorted(self._divergent), set()
        return [self.groups[i] for i in out]

    # -- one exchange ----------------------------------------------------------------------------------
    def post(self, post: Post, wanted: Sequence[FlatParamGroup] = (), flags: int = 0, label: str = "") -> RoundResult:
        """Run rounds until this rank has posted all of ``wanted`` (and its pending gradient announcements);
        apply what every rank asked for. For an END_* post, ``synced`` says whether every rank posted it."""
        assert self._pending is None, "zinf: a deferred round must be applied before the next one"
        gather_ids = [self._id[id(g)] for g in wanted]
        result = RoundResult()
        seen: set[int] = set()
        while True:
            chunk, gather_ids = gather_ids[:_SLOTS], gather_ids[_SLOTS:]
            ready = self._take_ready(_SLOTS - len(chunk))
            more = bool(gather_ids or self._ready_local)
            rows = self._exchange(post, flags, chunk, ready, more)
            if not self._apply(rows, post, label, result, seen):
                return result

    def post_deferred(self, wanted: Sequence[FlatParamGroup], label: str) -> bool:
        """Post a WORK round (prefetch) without waiting for it: ``apply_pending`` applies it before anything else is
        issued. False if it does not fit one message (then use ``post_work``)."""
        assert self._pending is None, "zinf: a deferred round must be applied before the next one"
        if len(wanted) > _SLOTS:
            return False
        ids = [self._id[id(g)] for g in wanted]
        ready = self._take_ready(_SLOTS - len(ids))
        out, work = self._start_exchange(Post.WORK, 0, ids, ready, bool(self._ready_local))
        self._pending = (out, work, label, list(wanted))
        return True

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def apply_pending(self) -> tuple[list[FlatParamGroup], list[FlatParamGroup]]:
        """Wait for the deferred round and apply it: (the gathers every rank starts now, this rank's own)."""
        assert self._pending is not None
        out, work, label, wanted = self._pending
        self._pending = None
        start = time.perf_counter()
        work.wait()
        self.timers.seconds["rounds"] += time.perf_counter() - start  # counted once, when it was posted
        result, seen = RoundResult(), set()
        if self._apply(self._rows(out), Post.WORK, label, result, seen):
            rest = self.post(Post.WORK, label=label)  # another rank had more to say
            result.gathers += [g for g in rest.gathers if self._id[id(g)] not in seen]
        return result.gathers, wanted

    def _take_ready(self, room: int) -> list[int]:
        ready, self._ready_local = self._ready_local[:room], self._ready_local[room:]
        return ready

    def _apply(self, rows: list[list[int]], post: Post, label: str, result: RoundResult, seen: set[int]) -> bool:
        """Apply one round's messages (the same on every rank); True if some rank has more to send."""
        self._check_abort(rows)
        posts = [int(r[0]) for r in rows]
        for row in rows:
            result.flags |= int(row[1])
        per_rank = [[int(x) for x in r[_HEADER : _HEADER + int(r[2])]] for r in rows]
        self._note_divergence(posts, per_rank, label)
        for ids in per_rank:
            for gid in ids:
                if gid not in seen:
                    seen.add(gid)
                    result.gathers.append(self.groups[gid])
        for r, row in enumerate(rows):
            start = _HEADER + int(row[2])
            for gid in row[start : start + int(row[3])]:
                self._ready_from.setdefault(int(gid), set()).add(r)
        any_more = any(int(r[4]) for r in rows)
        synced = post is not Post.WORK and all(p == post for p in posts) and not any_more
        if post is not Post.WORK and not any_more:
            ends = {Post(p) for p in posts if p not in (Post.WORK, post)}
            if ends:
                self.failed = True
                raise CollectiveMismatchError(
                    f"zinf: ranks reached different ends of a pass: this rank {post.name}, others "
                    f"{sorted(e.name for e in ends)}. Every rank must run the same passes (forward, backward, "
                    "eval) in the same order; check for rank-dependent calls of the model or of backward().")
        self._reduce_ready(final=synced and post is Post.END_BACKWARD)
        result.synced = synced
        return any_more

    def post_work(self, wanted: Sequence[FlatParamGroup], label: str) -> list[FlatParamGroup]:
        """This rank needs ``wanted`` gathered now: returns what every rank starts (``wanted`` among them)."""
        return self.post(Post.WORK, wanted, label=label).gathers

    def abort(self) -> None:
        """This rank's pass raised: one round tells every other rank to stop too (instead of waiting for it)."""
        self._exchange(Post.ABORT, 0, [], [], False)

    def _exchange(self, post: Post, flags: int, gathers: list[int], ready: list[int], more: bool) -> list[list[int]]:
        out, _ = self._start_exchange(post, flags, gathers, ready, more, wait=True)
        return self._rows(out)

    def _rows(self, out: torch.Tensor) -> list[list[int]]:
        """Every rank's message, as host integers."""
        return out.view(self.comm.world, -1).tolist()

    def _start_exchange(self, post: Post, flags: int, gathers: list[int], ready: list[int], more: bool,
                        wait: bool = False) -> tuple[torch.Tensor, Any]:
        ids = gathers + ready
        host = torch.zeros(_HEADER + _SLOTS, dtype=torch.int64)
        host[:_HEADER] = torch.tensor([int(post), flags, len(gathers), len(ready), int(more)])
        if ids:
            host[_HEADER : _HEADER + len(ids)] = torch.tensor(ids)
        out = torch.empty(self.comm.world * host.numel(), dtype=torch.int64)  # host memory: see [Note: host-side
        with self.timers.time("rounds"):                                      # agreement] in zinf/runtime/comm.py
            work = self.comm.host_all_gather_into(out, host, async_op=not wait)
        return out, work

    def _check_abort(self, rows: list[list[int]]) -> None:
        stopped = [r for r, row in enumerate(rows) if int(row[0]) == Post.ABORT and r != self.comm.rank]
        if stopped:
            self.failed = True
            raise ZinfError(f"zinf: the pass raised on rank(s) {stopped}; stopping here too instead of waiting for "
                            "them. The error is in their log.")

    def _note_divergence(self, posts: list[int], per_rank: list[list[int]], label: str) -> None:
        sets = [frozenset(ids) for ids in per_rank]
        if all(s == sets[0] for s in sets):
            return
        self.num_divergent_rounds += 1
        union = frozenset().union(*sets)
        differ = union - frozenset.intersection(*sets)
        if self.strict:
            lines = []
            for r, (p, ids) in enumerate(zip(posts, per_rank)):
                what = ", ".join(self.groups[i].name for i in ids) if ids else "nothing"
                where = "" if p == Post.WORK else f" (it is at {Post(p).name})"
                lines.append(f"rank {r} gathers {what}{where}")
            names = sorted({self.groups[i].name for i in differ})
            self.failed = True
            raise CollectiveMismatchError(
                "zinf: ranks disagree on which parameters to gather next (" + "; ".join(lines) + "). The control "
                "flow of the model differs between ranks here (mixture-of-experts routing, a layer skipped on some "
                f"ranks) around {names}. Fix: set divergence='auto' (the default) so that zinf serves every rank's "
                "gathers and groups such modules itself, or name the module that calls them (for a "
                "mixture-of-experts layer: the layer) in unit_modules, by name pattern or class name (e.g. "
                "unit_modules=['model.layers.*.mlp']), so that it is gathered as one unit.")
        self._divergent |= differ

    def _reduce_ready(self, final: bool) -> None:
        """Reduce-scatter, in group order, what every rank announced (at the end of a backward: what any did)."""
        world = self.comm.world
        due = sorted(gid for gid, ranks in self._ready_from.items() if final or len(ranks) == world)
        for gid in due:
            del self._ready_from[gid]
            self.reducer.reduce(self.groups[gid], self.reduce_dtype)

