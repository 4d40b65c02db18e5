"""Gathering a module's groups just in time, and the groups of the next modules ahead of time.

With several ranks no gather is started on this rank's say alone: each batch of gathers is posted in a
round and every rank starts what any rank asked for (see [Note: rounds] in zinf/schedule/rounds.py).

[Note: reading ahead within the pool]
A gather ahead holds a full buffer, so it is bounded by ``prefetch_bytes`` and ``prefetch_modules``; a read ahead
holds only a pool buffer of the shard. Reads used to run a fixed number of modules ahead (twice
``prefetch_modules``): half a decoder block of a 1.1B Llama, about 40 ms of the disk, while the modules in between
took about as long to compute, so the disk's queue ran dry at every block. With every rank of a host reading the
frozen shards whole (``offload.frozen_reads: whole``) the step waited 2.2 s on reads (7.9 s steps, 2 ranks, LoRA).

So reads run ahead by bytes: the shards of the modules after the running one, in the recorded order, up to
``read_ahead_bytes`` (a quarter of the pool: ``Placement.read_ahead_bytes``; the next module's whatever its size),
and only while the store has room beyond its reserve (``ShardStore.prefetch``). Not as far as the pool allows: a
read ahead that finds no room takes the room of shards kept for the backward ([Note: NVMe parameter slots] in
zinf/offload/nvme_param_store.py), so the backward read them again: 4.26 GB a rank a step instead of 3.70, and
slower steps. With a quarter of the pool the same step waited 0.5 s on reads, for the same 3.70 GB.

A cursor remembers the first module whose reads are not all started, so past the next ``2 * prefetch_modules``
modules (looked at again at every call, as before: a group used twice in a pass, recomputed and then in its
backward, or a layer called twice, gives its slot back after its first use, when the cursor has passed it) each
module's call looks only at modules not looked at yet in this pass. A read the store refuses for room is asked for
again from there at the next module.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Sequence

from torch import nn

from zinf.config_sections import OverlapConfig
from zinf.param.state import GroupState
from zinf.runtime.collectives import GatherBatch
from zinf.runtime.context import RunContext
from zinf.runtime.streams import InFlight
from zinf.runtime.logs import region
from zinf.units import format_bytes

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup
    from zinf.schedule.keep import BackwardKeep
    from zinf.schedule.rounds import Rounds

__all__ = ["ParamFetcher", "FetchCounts", "ReadAhead"]


class FetchCounts(NamedTuple):
    prefetched: int  # gathers started ahead of use
    demand: int  # gathers a module had to start itself
    peak_gathered_bytes: int


class ParamFetcher:
    """Holds on groups for the modules running now, and gathers-ahead within a byte budget."""

    def __init__(self, config: OverlapConfig, ctx: RunContext, rounds: "Rounds | None" = None,
                 read_ahead_bytes: int = 0) -> None:
        self.config = config
        self.ctx = ctx  # the gathers' process group and streams
        self.timers = ctx.timers
        self.host = ctx.host  # told of every full buffer allocated and freed
        self.rounds = rounds if rounds is not None and rounds.active else None
        self._ahead: list[FlatParamGroup] = []
        self.reads = ReadAhead(read_ahead_bytes)  # shard reads ahead of the running module, within the pool
        self._served: list[InFlight] = []  # batches that served other ranks' gathers, until joined
        self.keep: BackwardKeep | None = None  # the groups kept for a backward: see use_keep
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.num_prefetched = 0  # gathers started ahead of use
        self.num_demand = 0  # gathers a module had to start itself (trace not known yet, or no budget)

    def acquire(self, groups: Sequence[FlatParamGroup], label: str) -> None:
        self.apply_pending_round()
        todo = [g for g in groups if g.state is GroupState.SHARDED]
        limit = self.config.max_gathered_bytes
        if limit and todo:
            self._check_budget(todo, groups, label, limit)
        if todo:  # issue every gather first, then wait: the module's gathers run together
            self.num_demand += len(todo)
            self.gather_wanted(todo, label, ahead=False)
        waiting = [g for g in groups if g.state is GroupState.GATHERING]
        if waiting:
            with self.timers.time("all_gather"), region("all_gather", label):
                for g in waiting:
                    g.finish_gather()
        for g in groups:
            g.acquire(self.ctx)
        if self._served:
            self.join_served()

    def release(self, groups: Iterable[FlatParamGroup]) -> None:
        for g in groups:
            g.release()
            if g.state is GroupState.SHARDED:
                self._count(g, -1)

    def use_keep(self, keep: BackwardKeep) -> None:
        """The groups ``keep`` holds for a backward (see [Note: kept for backward] in zinf/schedule/keep.py) fill the
        prefetch window until the backward reaches them, and are given back first when a gather needs the room
        under ``max_gathered_bytes``."""
        self.keep = keep

    def prefetch(self, order: Sequence[nn.Module], position: int,
                 needed: Callable[[nn.Module], Sequence[FlatParamGroup]]) -> None:
        """The module at ``position`` of the recorded ``order`` runs: start the shard reads ahead of it that the pool
        has room for ([Note: reading ahead within the pool]), and gathers for the next
        modules' groups, at most ``prefetch_modules`` ahead and within the byte budget. With several ranks the round
        that asks for the gathers is not waited for here: it is applied by the next call that gathers
        (``apply_pending_round``), so a prefetch does not hold this rank until the others post theirs."""
        self.apply_pending_round()
        self.reads.advance(order, position, needed, 2 * self.config.prefetch_modules)
        upcoming = (needed(m) for m in order[position + 1 : position + 1 + self.config.prefetch_modules])
        self._ahead = [g for g in self._ahead if g.holds == 0 and g.state is not GroupState.SHARDED]
        budget = self.config.prefetch_bytes - sum(g.nbytes_full for g in self._ahead)
        if self.keep is not None:
            budget -= self.keep.kept_bytes()
        hard = self.config.max_gathered_bytes - self.gathered_bytes if self.config.max_gathered_bytes else None
        # [Note: one group ahead] a window smaller than the next group still gathers that group ahead when nothing
        # else is: the byte cap bounds how many groups run ahead, never whether one does (a 13B model's groups are
        # all larger than the default window, which made every gather wait). prefetch_bytes 0 turns it off.
        floor = self.config.prefetch_bytes > 0 and not self._ahead
        chosen: list[FlatParamGroup] = []
        covered = 0  # the next modules whose groups are all gathered or on their way, counted from the next one
        for n, groups in enumerate(upcoming):
            if covered == n and all(g.state is not GroupState.SHARDED for g in groups):
                covered += 1
            for g in groups:
                if g.state is not GroupState.SHARDED or g in chosen:
                    continue
                if g.update_pending and g.world == 1:
                    # its background update is not done: gathering now would stall this module. Only where
                    # the gather is not a collective: with several ranks every rank must start the same
                    # gathers in the same order, and whether an update is done yet differs between ranks.
                    continue
                over = g.nbytes_full > budget and not (floor and not chosen)
                if over or (hard is not None and g.nbytes_full > hard):
                    budget = -1  # the gather window is full; reads may still go ahead
                    continue
                budget -= g.nbytes_full
                if hard is not None:
                    hard -= g.nbytes_full
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
            if self.rounds is not None:
                chosen = self._read_whole(chosen, ahead=True)
            if chosen and (self.rounds is None or not self.rounds.post_deferred(chosen, "prefetch")):
                self.gather_wanted(chosen, "prefetch", ahead=True)

    def _check_budget(self, todo: Sequence[FlatParamGroup], groups: Sequence[FlatParamGroup], label: str,
                      limit: int) -> None:
        """A module whose gathers (``todo``, of the ``groups`` it needs) would pass ``overlap.max_gathered_bytes``
        stops the pass with the fix. Groups kept for a backward and groups gathered ahead but not held are given
        back first (neither needs to break the budget), except the module's own: giving one of those back would
        make its acquire gather it again on this rank alone, outside any round."""
        need = sum(g.nbytes_full for g in todo if g.owns_full)
        if self.gathered_bytes + need > limit:
            if self.keep is not None:
                self.keep.drop(but=groups)
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

    def apply_pending_round(self) -> None:
        """Apply a prefetch round still in flight (before anything else is issued: see [Note: rounds])."""
        if self.rounds is not None and self.rounds.pending:
            union, wanted = self.rounds.apply_pending()
            self.gather_union(union, wanted, ahead=True)

    def gather_wanted(self, wanted: Sequence[FlatParamGroup], label: str, ahead: bool) -> None:
        """Start the gathers of ``wanted`` (sharded groups) and, with several ranks, of whatever the other
        ranks ask for in the same round. Groups this rank did not ask for, and with ``ahead`` the ones it
        asked for, are released at the end of the pass unless a module takes them."""
        if self.rounds is None:
            union = list(wanted)
        else:  # acquire and prefetch have applied a pending round already
            wanted = self._read_whole(wanted, ahead)
            if not wanted:
                return  # nothing to post: rounds pair with rounds, so skipping one is always safe
            union = self.rounds.post_work(wanted, label)
        self.gather_union(union, wanted, ahead)

    def _read_whole(self, wanted: Sequence[FlatParamGroup], ahead: bool) -> list[FlatParamGroup]:
        """Start the gathers of the groups this rank reads whole (no round, no collective: [Note: frozen groups read
        whole] in zinf/offload/whole_reads.py); the others, to be agreed on in a round."""
        whole = [g for g in wanted if g.residence.whole]
        if whole:
            self.gather_union(whole, whole, ahead)
        return [g for g in wanted if not g.residence.whole]

    def gather_union(self, union: Sequence[FlatParamGroup], wanted: Sequence[FlatParamGroup] = (),
                     ahead: bool = True) -> None:
        """Start, in order, the gathers every rank agreed on (see [Note: rounds])."""
        mine = {id(g) for g in wanted}
        batch = self._batch(union)
        try:
            for g in union:
                if g.state is GroupState.SHARDED:
                    self._start_one(g, batch)
                    self._count(g, +1)
                    if ahead or id(g) not in mine:
                        self._ahead.append(g)
                else:  # gathered here already (held, or kept): take part with this rank's slice
                    with self.timers.time("all_gather"):
                        g.serve_gather(self.ctx, batch)
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
        comm = self.ctx.comm
        if sum(not g.residence.whole for g in union) < 2 or comm.world == 1 or not self.config.coalesces(comm.backend):
            return None
        return GatherBatch(self.ctx.comm, self.ctx.streams)

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

    def _start_one(self, g: FlatParamGroup, batch: GatherBatch | None = None) -> None:
        """Start a gather; the time it blocks (its shard's NVMe read, its pending background update) is
        gather time too."""
        with self.timers.time("all_gather"):
            g.start_gather(self.ctx, batch)

    def _count(self, g: FlatParamGroup, sign: int) -> None:
        if not g.owns_full or g.persistent:
            return  # one rank gathering in place (the "full" buffer is the shard itself), or gathered for the run
        self.gathered_bytes += sign * g.nbytes_full
        if sign < 0:
            self.host.freed("gathered", g.nbytes_full, g.device, kept=self.ctx.gather_cache(g.trainable) is not None)
        else:
            self.host.allocated("gathered", g.nbytes_full, g.device)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def take_counts(self) -> FetchCounts:
        """The gathers and the gathered peak since the last call (the peak starts again from what is held now)."""
        counts = FetchCounts(self.num_prefetched, self.num_demand, self.peak_gathered_bytes)
        self.num_prefetched = self.num_demand = 0
        self.peak_gathered_bytes = self.gathered_bytes
        return counts


class ReadAhead:
    """Starts the shard reads of the modules after the running one, in the recorded ``order``, while the pool has
    room; see [Note: reading ahead within the pool]."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._upto: list[int] = [0]  # the bytes read for the modules of ``_order`` before each
        self._order: Sequence[nn.Module] | None = None
        self._position = -1  # the last module of ``_order`` that ran
        self._next = 0  # the first module of ``_order`` whose reads are not all started

    def advance(self, order: Sequence[nn.Module], position: int,
                needed: Callable[[nn.Module], Sequence["FlatParamGroup"]], window: int) -> None:
        """The module at ``position`` of ``order`` runs: start the reads after it that the pool has room for. The
        next ``window`` modules are looked at again at every call: a group used twice in a pass (recomputed, then
        its backward; a layer called twice) gives its slot back after its first use, after the cursor passed it."""
        if not all(_start_reads(needed(m)) for m in order[position + 1 : position + 1 + window]):
            return
        if not self.limit_bytes:
            return  # nothing is read from a drive: the window's look is all there is
        if order is not self._order:
            self._order, self._next = order, 0
            self._upto = list(accumulate((sum(_read_bytes(g) for g in needed(m)) for m in order), initial=0))
        elif position <= self._position:  # a new pass of the same order
            self._next = 0
        self._position = position
        i = max(self._next, position + 1)
        limit = self._upto[position + 1] + self.limit_bytes
        while i < len(order) and (i == position + 1 or self._upto[i + 1] <= limit):  # the next module's at least
            if not _start_reads(needed(order[i])):
                self._next = i  # no room: asked for again from here at the next module
                return
            i += 1
        self._next = i


def _read_bytes(g: "FlatParamGroup") -> int:
    """The bytes a read of ``g``'s shard brings in: every rank's where the rank reads the group whole."""
    return g.shard_nbytes * (g.world if g.residence.whole else 1)


def _start_reads(groups: Sequence["FlatParamGroup"]) -> bool:
    """Start the reads of ``groups``' shards that are not read or gathered yet; False when the pool has no room."""
    return all(g.state is not GroupState.SHARDED or g.store.prefetch(g) for g in groups)
