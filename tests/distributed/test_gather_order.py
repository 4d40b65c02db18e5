"""Every rank starts the same gathers in the same order, even when the background optimizer step of one
rank runs behind the other's.

Whether a group's background update is done when the next forward looks ahead differs between ranks;
a prefetch decision taken on it would send the ranks' all-gathers out of order (gloo aborts on the size
mismatch, or two same-sized groups swap data silently). Rank 0's update is slowed here on purpose so
its updates are still pending when it looks ahead, while rank 1's are done."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import Recipe, reference

pytestmark = pytest.mark.distributed

STEPS = 6


def _worker(rank: int, world: int, nvme: str) -> dict[str, Any]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "sub_group_numel": 4096,
        "pinned_pool_bytes": 4 << 20}})
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model, "adamw"), config)
    if rank == 0:
        finish = engine.optimizer._finish_group

        def slow_finish(group: Any) -> None:
            time.sleep(0.02)
            finish(group)

        engine.optimizer._finish_group = slow_finish
    losses, pending_seen = [], 0
    for x, y in batches("gpt", STEPS, 8):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        pending_seen += sum(g.update_pending for g in engine.groups)
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    prefetched = engine.fetcher.num_prefetched
    engine.close()
    return {"losses": losses, "prefetched": prefetched, "pending_seen": pending_seen}


def test_a_rank_behind_on_its_update_gathers_in_the_same_order(tmp_path: Path) -> None:
    got = run_distributed(_worker, 2, str(tmp_path))
    assert got[0]["pending_seen"] > 0, "rank 0's background updates were never pending: the test shows nothing"
    assert got[0]["prefetched"] == got[1]["prefetched"], "the ranks started different gathers ahead of use"
    ref = reference(Recipe(kind="gpt", steps=STEPS))[0]
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got[0]["losses"]))
    assert rel < 1e-5, f"two ranks, one behind on its update: {rel:.2e} from PyTorch"
