"""[Note: one group ahead] in zinf/schedule/fetcher.py: a prefetch window smaller than every group still gathers the
next group ahead, one at a time; ``prefetch_bytes: 0`` turns prefetching off. The losses do not change."""

from __future__ import annotations

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import train_global

pytestmark = pytest.mark.distributed


def _run(rank: int, world: int, prefetch_bytes: int) -> dict:
    config = zinf.ZeroConfig.from_dict({"overlap": {"prefetch_bytes": prefetch_bytes}})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    smallest = min(g.nbytes_full for g in engine.groups)
    losses = train_global(engine, batches("gpt", 3, 8), rank, world)
    report = engine.report()
    engine.close()
    return {"losses": losses, "prefetched": report.counts["prefetched_gathers"], "smallest": smallest,
            "peak": report.peak_gathered_bytes}


@pytest.mark.slow
def test_a_window_smaller_than_every_group_still_gathers_one_ahead() -> None:
    tiny, off, roomy = (run_distributed(_run, 2, b)[0] for b in (1, 0, 64 << 20))
    assert tiny["smallest"] > 1  # no group fits the window
    assert tiny["prefetched"] > 0 and off["prefetched"] == 0
    assert tiny["losses"] == off["losses"] == roomy["losses"]
    assert tiny["peak"] <= roomy["peak"]
