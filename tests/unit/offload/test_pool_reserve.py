"""The pinned pool's reserve for the parameter store counts rewrites only where they happen: the largest shard once
(a read for a gather), the largest trained shard twice (an updated shard staged, one being written). A frozen base
is never rewritten, so a LoRA-like model keeps most of the pool for reading ahead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.offload.pool_room import block_bytes
from zinf.offload.swap import OffloadSpaceError

BASE = 1 << 20  # a frozen layer of 1 Mi fp32 elements: a 4 MiB shard, staged in an 8 MiB block (the record's trailer)


def _engine(tmp_path: Path, pool: int) -> zinf.ZeroInfinityEngine:
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [str(tmp_path)],
                                                 "pinned_pool_bytes": pool}})
    with zinf.Init(cfg):
        model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 8))
    model[0].requires_grad_(False)
    return zinf.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), cfg)


def test_a_frozen_base_leaves_the_rewrite_room_to_the_trained_shards(tmp_path: Path) -> None:
    big = block_bytes(BASE * 4 + 4096)
    engine = _engine(tmp_path, 24 << 20)
    small = block_bytes(1024 * 8 * 4 + 8 * 4 + 4096)
    assert engine.placement.store.reserve_bytes == big + 2 * small  # was 3 x big
    loss = engine(torch.randn(2, 1024)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.close()
    # the pool needs two of the frozen blocks (a read, a read ahead) and the rewrite room, not four blocks of it
    _engine(tmp_path, 2 * big + 2 * small).close()
    with pytest.raises(OffloadSpaceError, match="offload.pinned_pool_bytes"):
        _engine(tmp_path, 2 * big + 2 * small - 1)
