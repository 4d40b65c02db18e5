"""``offload.step_during_backward``: the CPU-Adam steps each group during the backward, and the result equals the
step taken after the backward bit for bit ([Note: steps during the backward] in zinf/optim/early_steps.py).

On 1 and 2 gloo ranks, fp32, the same run with early steps and without gives identical losses and identical final
weights (0.0 difference) with clipping active every step, clipping that never triggers (the early steps are kept),
2 micro-batches per step, a frozen group, a parameter used only on some steps and, on 2 ranks, by one rank only,
the background step on and off, and the staged device path (``ZINF_STAGED_DEVICE=1``). fp16 with a loss scale that
overflows: the skipped steps leave the weights as they were (the early steps are rolled back), and the run equals
the one without early steps.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import zinf
from dist_utils import run_distributed
from zinf.device_memory import STAGED_DEVICE_ENV

pytestmark = pytest.mark.distributed

STEPS = 6


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 64)  # frozen
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.sometimes = nn.Linear(64, 64)  # used on some steps only
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.embed(x).relu()
        for block in self.blocks:
            h = block(h).relu()
        if use:
            h = h + self.sometimes(h)
        return self.head(h)


def _train(rank: int, world: int, early: bool, clip: float, accum: int, background: bool, precision: str = "fp32",
           scale: float = 2.0**16) -> dict[str, Any]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({
        "precision": precision, "gradient_clipping": clip, "loss_scale": {"initial_scale": scale},
        "overlap": {"persistent_numel": 0},
        "offload": {"optimizer": "cpu", "sub_group_numel": 2048, "overlap_optimizer": background,
                    "step_during_backward": early}})
    with zinf.Init(config):
        model = _Net()
    model.embed.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    engine = zinf.initialize(model, opt, config)
    g = torch.Generator().manual_seed(1)
    losses, stepped = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        use = step % 3 == 0 or (step % 3 == 1 and rank == 0)
        for xm, ym in zip(x.chunk(world)[rank].chunk(accum), y.chunk(world)[rank].chunk(accum)):
            loss = nn.functional.mse_loss(engine(xm.to(engine.config.compute_dtype), use).float(), ym) / accum
            engine.backward(loss)
            losses.append(loss.item())
        stepped.append(engine.step())
    early_steps = engine.optimizer.early
    counts = (early_steps.num_kept, early_steps.num_redone) if early_steps is not None else (0, 0)
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return {"losses": losses, "state": state, "stepped": stepped, "counts": counts}


def _pair(rank: int, world: int, staged: bool, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if staged:
        os.environ[STAGED_DEVICE_ENV] = "1"
    return {name: (_train(rank, world, False, **kw), _train(rank, world, True, **kw)) for name, kw in cases.items()}


CASES = {
    "clip active": {"clip": 0.05, "accum": 1, "background": True},
    "clip never triggers": {"clip": 1e3, "accum": 1, "background": True},
    "no clip, accum=2, foreground": {"clip": 0.0, "accum": 2, "background": False},
}


@pytest.mark.parametrize("world,staged", [(1, False), (2, False), (2, True)])
def test_early_steps_equal_the_step_after_the_backward(world: int, staged: bool) -> None:
    got = run_distributed(_pair, world, staged, CASES)
    for rank, results in enumerate(got):
        for name, (plain, early) in results.items():
            assert plain["losses"] == early["losses"], f"rank {rank}, {name}: losses differ"
            for k, v in plain["state"].items():
                assert torch.equal(v, early["state"][k]), f"rank {rank}, {name}: {k} differs"
            kept, redone = early["counts"]
            assert kept + redone > 0, f"{name}: no step was taken during the backward"
            if name == "clip never triggers":
                assert kept > 0, f"{name}: every early step was redone ({redone})"
    assert got[0]["clip active"][1]["counts"][0] == 0  # clipped: the early steps are never the step


def _fp16(rank: int, world: int) -> dict[str, Any]:
    return {"plain": _train(rank, world, False, 0.0, 1, True, "fp16", 2.0**40),
            "early": _train(rank, world, True, 0.0, 1, True, "fp16", 2.0**40)}


def test_fp16_overflow_still_skips() -> None:
    got = run_distributed(_fp16, 2)[0]
    plain, early = got["plain"], got["early"]
    assert early["stepped"][0] is False and early["stepped"] == plain["stepped"]
    assert plain["losses"] == early["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(v, early["state"][k]), f"{k} differs"
