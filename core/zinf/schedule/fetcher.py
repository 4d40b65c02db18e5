"""Gathering a module's groups just in time, and the groups of the next modules ahead of time.

With several ranks no gather is started on this rank's say alone: each batch of gathers is posted in a
round and every rank starts what any rank asked for (see [Note: rounds] in zinf/schedule/rounds.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

from zinf.config import OverlapConfig
from zinf.host_memory import HostMemory
from zinf.param.state import GroupState
from zinf.runtime.gather_batch import GatherBatch
from zinf.runtime.streams import InFlight, region, streams_for
from zinf.report import StepTimers
from zinf.units import format_bytes

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup
    from zinf.schedule.rounds import Rounds

__all__ = ["ParamFetcher", "FetchCounts"]


class FetchCounts(NamedTuple):
    prefetched: int  # gathers started ahead of use
    demand: int  # gathers a module had to start itself
    peak_gathered_bytes: int


class ParamFetcher:
    """Holds on groups for the modules running now, and gathers-ahead within a byte budget."""

    def __init__(self, config: OverlapConfig, timers: StepTimers, rounds: "Rounds | None" = None,
                 host: HostMemory | None = None) -> None:
        self.config = config
        self.timers = timers
        self.host = host if host is not None else HostMemory()  # told of every full buffer allocated and freed
        self.rounds = rounds if rounds is not None and rounds.active else None
        self._ahead: list[FlatParamGroup] = []
        self._served: list[InFlight] = []  # batches that served other ranks' gathers, until joined
        self._kept: list[FlatParamGroup] = []  # kept gathered by a forward for its backward, not taken by one yet
        self._kept_taken: list[FlatParamGroup] = []  # what the running backward took over, until a module uses it
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.num_prefetched = 0  # gathers started ahead of use
        self.num_demand = 0  # gathers a module had to start itself (trace not known yet, or no budget)

    def acquire(self, groups: Sequence[FlatParamGroup], label: str) -> None:
        self.settle()
        todo = [g for g in groups if g.state is GroupState.SHARDED]
        limit = self.config.max_gathered_bytes
        if limit and todo:
            self._check_budget(todo, groups, label, limit)
        if todo:  # issue every gather first, then wait: the module's gathers run together
            self.num_demand += len(todo)
            self.start(todo, label, ahead=False)
        waiting = [g for g in groups if g.state is GroupState.GATHERING]
        if waiting:
            with self.timers.time("all_gather"), region("all_gather", label):
                for g in waiting:
                    g.finish_gather()
        for g in groups:
            g.acquire()
        if self._served:
            self.join_served()

    def release(self, groups: Iterable[FlatParamGroup]) -> None:
        for g in groups:
            g.release()
            if g.state is GroupState.SHARDED:
                self._count(g, -1)

    def keep(self, groups: Sequence[FlatParamGroup]) -> None:
        """A forward call's hold on ``groups`` becomes their backward's (see [Note: kept for backward] in
        zinf/schedule/keep.py): they stay gathered, and the release that ends their backward ends it."""
        for g in groups:
            g.hold_for_backward()
        self._kept.extend(groups)

    def kept_to_backward(self) -> None:
        """A backward started: what the forward kept is the backward's now (released as its gradients complete)."""
        self._kept_taken, self._kept = self._kept, []

    def drop_kept(self, but: Sequence[FlatParamGroup] = ()) -> None:
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

    def _kept_bytes(self) -> int:
        """Bytes kept for a backward that has not reached them yet: they fill the prefetch window as gathers ahead
        do, so that the parameters gathered at once stay within what the window allows."""
        if self.config.reshard_after_forward == "never":
            return 0  # everything is kept by request: counting it would turn the forward's prefetch off
        self._kept_taken = [g for g in self._kept_taken if g.backward_held]
        return sum(g.nbytes_full for g in (*self._kept, *self._kept_taken) if g.owns_full and not g.persistent)

    def prefetch(self, upcoming: Iterable[Sequence[FlatParamGroup]]) -> None:
        """Start gathers for the next modules' groups, at most ``prefetch_modules`` ahead and within the byte budget.
        With several ranks the round that asks for them is not waited for here: it is applied by the next
        call that gathers (``settle``), so a prefetch does not hold this rank until the others post theirs."""
        self.settle()
        self._ahead = [g for g in self._ahead if g.holds == 0 and g.state is not GroupState.SHARDED]
        budget = self.config.prefetch_bytes - sum(g.nbytes_full for g in self._ahead) - self._kept_bytes()
        if self.config.max_gathered_bytes:
            budget = min(budget, self.config.max_gathered_bytes - self.gathered_bytes)
        reading = True
        chosen: list[FlatParamGroup] = []
        covered = 0  # the next modules whose groups are all gathered or on their way, counted from the next one
        for n, groups in enumerate(upcoming):
            if n >= 2 * self.config.prefetch_modules:
                break
            if covered == n and all(g.state is not GroupState.SHARDED for g in groups):
                covered += 1
            # shard reads (NVMe -> pinned pool) run twice as far ahead as gathers, bounded by the pool
            for g in groups:
                if reading and g.state is GroupState.SHARDED:
                    reading = g.store.prefetch(g)
            if n >= self.config.prefetch_modules:
                continue
            for g in groups:
                if g.state is not GroupState.SHARDED or g in chosen:
                    continue
                if g.update_pending and g.comm.world == 1:
                    # its background update is not done: gathering now would stall this module. Only where
                    # the gather is not a collective: with several ranks every rank must start the same
                    # gathers in the same order, and whether an update is done yet differs between ranks.
                    continue
                if g.nbytes_full > budget:
                    budget = -1  # the gather window is full; reads may still go ahead
                    continue
                budget -= g.nbytes_full
                chosen.append(g)
        if chosen and covered * 2 >= self.config.prefetch_modules:
            # [Note: prefetch in batches] the window is still at least half full: ask for nothing now. With several
            # ranks each prefetch is a round (see [Note: rounds]); refilling the window only once half of it is used
            # asks for about half the window's modules per round, where topping it up at every module cost one
            # round per module (54 per step of a 4-layer GPT; bench_rounds.py). Which groups are gathered is
            # unchanged; only how many are asked for at once.
            chosen = []
        if chosen:
            self.num_prefetched += len(chosen)
            if self.rounds is None or not self.rounds.post_deferred(chosen, "prefetch"):
                self.start(chosen, "prefetch", ahead=True)

    def _check_budget(self, todo: Sequence[FlatParamGroup], groups: Sequence[FlatParamGroup], label: str,
                      limit: int) -> None:
        """A module whose gathers (``todo``, of the ``groups`` it needs) would pass ``overlap.max_gathered_bytes``
        stops the pass with the fix. Groups kept for a backward and groups gathered ahead but not held are given
        back first (neither needs to break the budget), except the module's own: giving one of those back would
        make its acquire gather it again on this rank alone, outside any round."""
        need = sum(g.nbytes_full for g in todo if g.owns_full)
        if self.gathered_bytes + need > limit:
            self.drop_kept(but=groups)
            for g in self._ahead:
                if (g.holds == 0 and g.state is GroupState.GATHERED and not g.persistent and not g.backward_held
                        and all(g is not n for n in groups)):
                    g.to_sharded()
                    self._count(g, -1)
        if self.gathered_bytes + need > limit:
            from zinf.errors import UnsupportedModelError

            held = self.gathered_bytes
            raise UnsupportedModelError(
                f"zinf: {label or 'the model'} needs {format_bytes(need)} of parameters gathered at once "
                f"({format_bytes(held)} already held), above overlap.max_gathered_bytes = {format_bytes(limit)}. Tile "
                "its large linear layers (tiling.min_numel and tiling.max_tile_bytes, or zinf.TiledLinear), or raise "
                "overlap.max_gathered_bytes.")

    def settle(self) -> None:
        """Apply a prefetch round still in flight (before anything else is issued: see [Note: rounds])."""
        if self.rounds is not None and self.rounds.pending:
            union, wanted = self.rounds.settle()
            self.gather_union(union, wanted, ahead=True)

    def start(self, wanted: Sequence[FlatParamGroup], label: str, ahead: bool) -> None:
        """Start the gathers of ``wanted`` (sharded groups) and, with several ranks, of whatever the other
        ranks ask for in the same round. Groups this rank did not ask for, and with ``ahead`` the ones it
        asked for, are released at the end of the pass unless a module takes them."""
        if self.rounds is None:
            union = list(wanted)
        else:  # acquire and prefetch have settled a deferred round already
            if not wanted:
                return  # nothing to post: rounds pair with rounds, so skipping one is always safe
            union = self.rounds.post_work(wanted, label)
        self.gather_union(union, wanted, ahead)

    def gather_union(self, union: Sequence[FlatParamGroup], wanted: Sequence[FlatParamGroup] = (),
                     ahead: bool = True) -> None:
        """Start, in order, the gathers every rank agreed on (see [Note: rounds])."""
        mine = {id(g) for g in wanted}
        batch = self._batch(union)
        try:
            for g in union:
                if g.state is GroupState.SHARDED:
                    self._start(g, batch)
                    self._count(g, +1)
                    if ahead or id(g) not in mine:
                        self._ahead.append(g)
                else:  # gathered here already (held, or kept): take part with this rank's slice
                    with self.timers.time("all_gather"):
                        g.serve_gather(batch)
        except BaseException:
            if batch is not None:  # its groups are unwound with the pass; their waits must not stop the unwinding
                batch.work.abandon()
            raise
        if batch is not None:
            with self.timers.time("all_gather"), region("all_gather", f"{len(batch)} groups"):
                served = batch.issue()
            if served is not None:
                self._served.append(served)

    def _batch(self, union: Sequence[FlatParamGroup]) -> GatherBatch | None:
        """One collective for the union's gathers ([Note: one collective per round]); None where one would do."""
        if len(union) < 2 or union[0].comm.world == 1 or not self.config.coalesces(union[0].comm.backend):
            return None
        return GatherBatch(union[0].comm, streams_for(union[0].device))

    def join_served(self) -> None:
        """Wait for the batches that served other ranks' gathers, and drop their scratch buffers."""
        for work in self._served:
            with self.timers.time("all_gather"):
                work.join()
        self._served.clear()

    def sweep(self) -> None:
        """End of a pass: groups gathered ahead but never used go back to their shards."""
        self.join_served()
        for g in self._ahead:
            if g.state is GroupState.GATHERING:
                g.finish_gather()
            if g.holds == 0 and g.state is GroupState.GATHERED and not g.persistent and not g.backward_held:
                g.to_sharded()
                self._count(g, -1)
        self._ahead.clear()

    def _start(self, g: FlatParamGroup, batch: GatherBatch | None = None) -> None:
        """Start a gather; the time it blocks (its shard's NVMe read, its pending background update) is
        gather time too."""
        with self.timers.time("all_gather"):
            g.start_gather(batch)

    def _count(self, g: FlatParamGroup, sign: int) -> None:
        if not g.owns_full:
            return  # one rank gathering in place: the "full" buffer is the shard itself
        self.gathered_bytes += sign * g.nbytes_full
        if sign < 0:
            self.host.freed("gathered", g.nbytes_full, g.device)
        else:
            self.host.allocated("gathered", g.nbytes_full, g.device)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def take_counts(self) -> FetchCounts:
        """The gathers and the gathered peak since the last call (the peak starts again from what is held now)."""
        counts = FetchCounts(self.num_prefetched, self.num_demand, self.peak_gathered_bytes)
        self.num_prefetched = self.num_demand = 0
        self.peak_gathered_bytes = self.gathered_bytes
        return counts
