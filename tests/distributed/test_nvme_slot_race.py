"""A gather's NVMe slot cannot be evicted between its read and its use.

Parameters on NVMe, the optimizer on the CPU stepping in the background (``overlap_optimizer``), and a pinned
pool a third of a rank's shards: the background step makes room while the next forward gathers. Before the fix
the room-maker could drop the slot that ``NvmeShardStore.fetch`` had just read into, between the read and the
gather taking it: a KeyError on one rank, then a collective mismatch that aborted both (4 of 4 runs of this test
failed). Three engines one after the other, three steps each, on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, make_optimizer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _train(rank: int, world: int, nvme: str) -> list[float]:
    cfg = GPTConfig(vocab=512, block=32, n_embd=256, n_head=4, n_layer=8)
    losses = []
    for _ in range(3):
        torch.manual_seed(0)
        config = zinf.ZeroConfig.from_dict({"offload": {
            "params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20,
            "overlap_optimizer": True}})
        with zinf.Init(config):
            model = GPT(cfg)
        engine = zinf.initialize(model, make_optimizer(model), config)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            idx = torch.randint(0, cfg.vocab, (4, cfg.block + 1), generator=g)
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        dist.barrier()
    return losses


def test_background_step_never_evicts_a_slot_being_gathered(tmp_path: Path) -> None:
    losses = run_distributed(_train, 2, str(tmp_path))
    for rank_losses in losses:  # every engine started from the same weights and data: the same losses
        assert rank_losses[0:3] == rank_losses[3:6] == rank_losses[6:9], rank_losses
