"""[Note: one collective per round] (zinf/runtime/collectives.py): a round's gathers issued as one coalesced
collective move the same bytes as one all-gather each, across dtypes and sizes (an empty shard among them), with
some groups only served (this rank's slice into scratch) and the rest started; and the engine issues one
collective per round where it issued one per group before, with bit-identical losses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import train_global
from zinf.runtime.comm import Comm
from zinf.runtime.collectives import GatherBatch
from zinf.runtime.streams import Streams

pytestmark = pytest.mark.distributed

SHAPES = [(7, torch.float32), (5, torch.bfloat16), (0, torch.float32), (11, torch.float16), (3, torch.float64)]


def _shard(rank: int, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float64) * 0.25 + 100 * rank + 10 * i).to(dtype)


def _batched(rank: int, world: int) -> dict:
    comm = Comm.current()
    batch = GatherBatch(comm, Streams(torch.device("cpu")))
    outs, joins = [], []
    for i, (numel, dtype) in enumerate(SHAPES):
        out = torch.full((numel * world,), -1.0, dtype=dtype)
        if i % 2 and rank == 1:  # rank 1 only serves these (it has them gathered already): scratch receives them
            batch.serve(out, _shard(rank, i, numel, dtype))
        else:
            joins.append(batch.start(out, _shard(rank, i, numel, dtype), (out,)))
        outs.append(out)
    served = batch.issue()
    for work in joins:
        work.join()
    if served is not None:
        served.join()
    singles = []
    for i, (numel, dtype) in enumerate(SHAPES):
        out = torch.empty(numel * world, dtype=dtype)
        dist.all_gather_into_tensor(out, _shard(rank, i, numel, dtype))
        singles.append(out)
    return {"batched": outs, "single": singles, "served": served is not None}


def test_one_collective_moves_what_one_gather_each_moves() -> None:
    for rank, result in enumerate(run_distributed(_batched, 2)):
        assert result["served"] == (rank == 1)
        for i, (batched, single) in enumerate(zip(result["batched"], result["single"])):
            assert batched.dtype == single.dtype and torch.equal(batched, single), (rank, i, batched, single)
            expected = torch.cat([_shard(r, i, SHAPES[i][0], SHAPES[i][1]) for r in range(2)])
            assert torch.equal(batched, expected), (rank, i)


def _engine(rank: int, world: int, coalesce: str) -> dict:
    import zinf.schedule.fetcher as gather

    counts = {"collectives": 0, "unions": 0, "groups": 0}
    issue = GatherBatch.issue

    def counted_issue(self: GatherBatch):
        counts["collectives"] += bool(len(self))
        return issue(self)

    GatherBatch.issue = counted_issue
    union_of = gather.ParamFetcher.gather_union

    def counted_union(self, union, *args, **kwargs):
        counts["unions"] += bool(union)
        counts["groups"] += len(union)
        return union_of(self, union, *args, **kwargs)

    gather.ParamFetcher.gather_union = counted_union
    single = Comm.all_gather_into

    def counted_single(self: Comm, out, shard, async_op):
        counts["collectives"] += 1
        return single(self, out, shard, async_op)

    Comm.all_gather_into = counted_single  # a round's message goes by Comm.host_all_gather_into: not counted
    torch.manual_seed(0)
    with zinf.Init():
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model, "adamw"),
                             {"precision": "fp32", "overlap": {"coalesce_gathers": coalesce}})
    counts.update(collectives=0, unions=0, groups=0)  # the steps' gathers only
    losses = train_global(engine, batches("gpt", steps=3, batch=4), rank, world)
    engine.close()
    return {"losses": losses, **counts}


def test_the_engine_issues_one_collective_per_round_with_the_same_losses() -> None:
    batched = run_distributed(_engine, 2, "auto")  # the default: on with gloo
    single = run_distributed(_engine, 2, "off")
    for b, s in zip(batched, single):
        assert b["losses"] == s["losses"]  # the same bytes gathered: bit-identical steps
        assert b["unions"] == s["unions"] and b["groups"] == s["groups"] > b["unions"]  # the same rounds
        assert s["collectives"] == s["groups"]  # one all-gather per group before
        assert b["collectives"] == b["unions"], b  # one per round now (the model has one dtype)
