"""One collective for the gathers of one round.

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
from zinf.runtime.streams import InFlight, SharedWork, Streams

__all__ = ["BatchWork", "GatherBatch"]


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

    def start(self, out: torch.Tensor, shard: torch.Tensor, keep: tuple[torch.Tensor, ...]) -> InFlight:
        """Gather ``shard`` from every rank into ``out`` with the batch; the InFlight to join before reading it."""
        self._outs.append(out)
        self._shards.append(shard)
        return InFlight(self.streams, self.streams.all_gather, self.work, keep)

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
        self.streams.all_gather.wait_stream(self.streams.current())  # every buffer was allocated on compute
        with self.streams.use(self.streams.all_gather):
            self.work.issued(self.comm.all_gather_coalesced(self._outs, self._shards))
        self._outs, self._shards = [], []
        served, self._served = tuple(self._served), []
        return InFlight(self.streams, self.streams.all_gather, self.work, served) if served else None
