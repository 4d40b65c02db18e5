"""The data collectives and their stream choreography: a group's all-gather, a round's batch of them, serving another
rank's gather, the fp32 master gather and the gradients' reduce-scatter. Callers decide when; this file decides how
(which stream, what waits for what, what is kept alive until compute has waited; see [Note: streams] in
zinf/runtime/streams.py). Every all-gather and reduce-scatter of tensors in zinf is issued here.

[Note: one collective per round]
With several ranks, every gather is started from a round's union (see [Note: rounds] in
zinf/schedule/rounds.py): the same groups, in the same order, on every rank. Issued one by one, each
of those gathers pays a collective's fixed cost (on gloo a round trip between the ranks; on NCCL a kernel launch
and a proxy round trip).
A :class:`GatherBatch` collects them instead, the groups this rank starts (shard -> full buffer) and
the ones it only serves (this rank's slice -> scratch), and issues them as one coalesced collective
(torch's coalescing manager: one ``all_gather_into_tensor_coalesced`` on the backend; with NCCL one grouped
launch). The values moved are the same bytes, in the same places; only the number of collectives changes. It is
``overlap.coalesce_gathers``, on by default on every backend: with each block gathered as one unit (see [Note:
blocks as units] in zinf/schedule/units.py) a round carries a whole block's groups, so a block costs one
collective, as FSDP2's one all-gather per ``fully_shard`` module.

Each started group keeps an :class:`~zinf.runtime.streams.InFlight` on the batch's one handle
(:class:`BatchWork`), so a module still waits only where it reads its own parameters; the first join
waits for the whole batch, later ones find it done. What only served another rank (its scratch and
slice) is held by one more InFlight until the caller joins it (``ParamFetcher`` does at the next
module's gathers or the end of the pass).

Stream order on CUDA is that of a single gather (rule 1 of [Note: streams]): every buffer is
allocated on compute before :meth:`GatherBatch.issue`, which makes the all-gather stream wait for
compute once, then issues the collective there.
"""

from __future__ import annotations

from typing import Any

import torch

from zinf.runtime.comm import Comm
from zinf.runtime.context import RunContext
from zinf.runtime.streams import InFlight, SharedWork, Streams
from zinf.runtime.logs import region

__all__ = ["BatchWork", "GatherBatch", "all_gather", "all_gather_now", "reduce_scatter", "serve_all_gather"]


def all_gather(ctx: RunContext, out: torch.Tensor, shard: torch.Tensor, name: str,
               batch: "GatherBatch | None" = None) -> InFlight:
    """Gather every rank's ``shard`` into ``out`` (rank-major), issued on the all_gather stream once it has waited for
    compute (``out`` was allocated there; rule 1 of [Note: streams]); with a ``batch``, as a part of the round's one
    collective. Returns the work to join before ``out`` is read, holding both tensors until then. ``out is shard``
    (one rank reading a narrow shard as it is) moves nothing but orders the same."""
    if batch is not None and out is not shard:
        return batch.start(out, shard, (shard, out))
    streams = ctx.streams
    with region("all_gather", name):
        return streams.issue(streams.all_gather,
                             lambda: None if out is shard else ctx.comm.all_gather_into(out, shard, async_op=True),
                             (shard, out))


def serve_all_gather(ctx: RunContext, scratch: torch.Tensor, mine: torch.Tensor, name: str,
                     batch: "GatherBatch | None" = None) -> None:
    """Take part in another rank's gather with this rank's slice ``mine``; ``scratch`` (allocated on compute) receives
    what this rank does not need. With a ``batch`` the round's collective carries it (the batch holds both until it
    is joined); alone, the gather runs now and compute waits for it before the scratch is dropped."""
    streams = ctx.streams
    with region("all_gather", name):
        if batch is not None:
            batch.serve(scratch, mine)
            return
        def launch() -> None:  # the host waits for it; compute then waits before the scratch is dropped
            ctx.comm.all_gather_into(scratch, mine, async_op=False)

        streams.issue(streams.all_gather, launch, (scratch,)).join()


def all_gather_now(comm: Comm, out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` into ``out`` (rank-major), the host waiting: the fp32 master gathers of checkpoints,
    exports and regrouping, which run outside any pass, and the planner's measurement of the collective."""
    comm.all_gather_into(out, local.to(out.device), async_op=False)
    return out


def reduce_scatter(ctx: RunContext, out: torch.Tensor, full: torch.Tensor, name: str) -> InFlight:
    """This rank's slice of the sum over ranks of ``full`` into ``out``, issued on the reduce_scatter stream once it
    has waited for compute (the gradients in ``full`` and ``out`` were made there). The returned work holds both until
    compute has waited for it."""
    streams = ctx.streams
    with region("reduce_scatter", name):
        return streams.issue(streams.reduce_scatter,
                             lambda: ctx.comm.reduce_scatter_sum(out, full.view(-1), async_op=True), (full, out))


class BatchWork(SharedWork):
    """The handle of a batch's collective, shared by every group gathered in it: waited for, and joined by
    compute, once (the first group's join; see :class:`~zinf.runtime.streams.SharedWork`)."""

    __slots__ = ("_work", "_issued")

    def __init__(self) -> None:
        super().__init__()
        self._work: Any = None
        self._issued = False

    def issued(self, work: Any) -> None:
        assert not self._issued, "zinf: a gather batch is issued once"
        self._work, self._issued = work, True

    def abandon(self) -> None:
        """The union raised before the batch was issued: there is nothing to wait for, and the groups it started
        hold no values (the pass is unwinding; they go back to their shards)."""
        self._work, self._issued = None, True

    def wait(self) -> None:
        assert self._issued, "zinf: a batched gather was waited for before its batch was issued"
        if self._work is not None:
            self._work.wait()
            self._work = None


class GatherBatch:
    """The all-gathers of one round, collected in round order and issued together."""

    def __init__(self, comm: Comm, streams: Streams) -> None:
        self.comm = comm
        self.streams = streams
        self.work = BatchWork()
        self._outs: list[torch.Tensor] = []
        self._shards: list[torch.Tensor] = []
        self._served: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._outs)

    def start(self, out: torch.Tensor, shard: torch.Tensor, alive: tuple[torch.Tensor, ...]) -> InFlight:
        """Gather ``shard`` from every rank into ``out`` with the batch; the InFlight to join before reading it."""
        self._outs.append(out)
        self._shards.append(shard)
        return InFlight(self.streams, self.streams.all_gather, self.work, alive)

    def serve(self, scratch: torch.Tensor, mine: torch.Tensor) -> None:
        """Take part in another rank's gather with this rank's slice; ``scratch`` receives what is not needed."""
        self._outs.append(scratch)
        self._shards.append(mine)
        self._served += [scratch, mine]

    def issue(self) -> InFlight | None:
        """Issue the one collective; returns the InFlight that holds what was only served (None if nothing was)."""
        if not self._outs:
            self.work.issued(None)
            return None
        outs, shards, served = self._outs, self._shards, tuple(self._served)
        self._outs, self._shards, self._served = [], [], []

        def launch() -> BatchWork:  # every buffer was allocated on compute, which the stream waits for first
            self.work.issued(self.comm.all_gather_coalesced(outs, shards))
            return self.work

        held = self.streams.issue(self.streams.all_gather, launch, served)
        return held if served else None
