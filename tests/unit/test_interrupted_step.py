"""An offloaded optimizer step cut short before its sweep is handed over (a Ctrl-C, an error) fails the step: later
calls raise at once, naming a restart from a checkpoint, instead of waiting for a sweep that never runs, and the
engine still closes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.errors import ZinfError
from zinf.optim import offloaded


def test_an_interrupted_step_fails_the_step_and_nothing_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path)],
                                                    "pinned_pool_bytes": 4 << 20}})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)

    def step() -> None:
        engine.backward(engine(torch.randn(8, 64)).square().mean())
        engine.step()

    step()

    def interrupted(optimizer: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(offloaded, "wait_at_exit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step()
    for call in (engine.synchronize, step, lambda: engine.save_checkpoint(str(tmp_path / "ckpt"))):
        with pytest.raises(ZinfError, match="interrupted part way .KeyboardInterrupt.*Restart from the last checkpoint"):
            call()
    engine.close(wait_for_ranks=False)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".swap")]
