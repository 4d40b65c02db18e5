"""An LR scheduler stepped right after engine.step() must not change the running background step.

Regression: the offloaded Adam read the learning rate while it ran in the background, so a scheduler
stepped after engine.step() returned changed the rate of sub-groups not yet stepped (6e-4 relative loss
error on the second step). Hyper-parameters are now read when step() is called.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zinf
from models import GPTConfig, GPT

STEPS = 8


def _losses(offload: dict) -> list[float]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {**offload, "sub_group_numel": 2048}})
    with zinf.Init(config):
        model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    engine = zinf.initialize(model, opt, config)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        idx = torch.randint(0, 96, (4, 17), generator=g)
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        sched.step()  # while the offloaded step may still be running
        out.append(loss.item())
    engine.close()
    return out


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_scheduler_after_step_matches_device_optimizer(tier: str, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _losses({})
        got = _losses({"optimizer": tier, "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 4 << 20})
    finally:
        torch.set_num_threads(threads)
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert rel < 1e-6, f"CPU-Adam on {tier} with a scheduler drifted {rel:.2e} from the torch optimizer"
