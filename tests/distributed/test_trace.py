"""The recorded module order drives prefetch; a changed order is detected, agreed on, and re-recorded."""

from __future__ import annotations

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import Switch
from training import step_global

pytestmark = pytest.mark.distributed

STEPS, FLIP = 12, 6


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _reference() -> list[float]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Switch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for i, (x, y) in enumerate(_data()):
        model.reverse = i >= FLIP
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"prefetch_bytes": 1 << 20, "prefetch_modules": 2}})
    with zinf.Init(config):
        model = Switch()
    engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), config)
    losses, prefetched = [], []
    for i, (x, y) in enumerate(_data()):
        model.reverse = i >= FLIP
        losses.append(step_global(engine, x, y, rank, world))
        prefetched.append(engine.report().counts["prefetched_gathers"])
    return {"losses": losses, "prefetched": prefetched,
            "rerecords": {k: t.num_rerecords for k, t in engine.hooks.traces.items()}}


def test_changed_order_is_rerecorded_and_training_stays_exact() -> None:
    ref = _reference()
    results = run_distributed(_worker, 2)
    for r in results:
        rel = max(abs(a - b) / abs(a) for a, b in zip(ref, r["losses"]))
        assert rel < 1e-5, f"max relative loss difference {rel:.2e}"
        assert r["rerecords"]["forward"] == 1 and r["rerecords"]["backward"] == 1, r["rerecords"]
        p = r["prefetched"]
        assert p[0] == 0, "the first step only records; nothing can be prefetched yet"
        assert all(n > 0 for n in p[1:FLIP]), f"replayed steps must prefetch: {p}"
        assert 0 < p[FLIP] < p[FLIP - 1], f"the changed step prefetches until it leaves the recorded order: {p}"
        assert p[FLIP + 1] == 0, f"the step after the change records afresh: {p}"
        assert all(n > 0 for n in p[FLIP + 2 :]), f"after re-recording, prefetch resumes: {p}"
    assert results[0]["prefetched"] == results[1]["prefetched"], "ranks prefetched differently"
