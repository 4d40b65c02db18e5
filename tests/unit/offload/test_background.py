"""The background optimizer step gives exactly the numbers of the synchronous one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf


def _losses(overlap: bool, persistent: int, offload: dict) -> list[float]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"persistent_numel": persistent},
                                        "offload": {**offload, "overlap_optimizer": overlap}})
    model = nn.Sequential(nn.Linear(512, 2048), nn.Tanh(), nn.Linear(2048, 512), nn.Tanh(), nn.Linear(512, 4))
    engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(engine(torch.randn(16, 512, generator=g)), torch.randint(0, 4, (16,), generator=g))
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    engine.close()
    return out


@pytest.mark.parametrize("persistent", [0, 1 << 30], ids=["sharded", "persistent"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_background_equals_synchronous(tier: str, persistent: int, tmp_path: Path) -> None:
    # regression: groups that stay gathered (persistent, or one rank gathering in place) were read by the
    # next forward while the background step was still writing them
    offload = {"optimizer": tier, "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 128 << 20}
    assert _losses(True, persistent, offload) == _losses(False, persistent, offload)
