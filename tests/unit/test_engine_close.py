"""After ``engine.close()`` the model's groups live as long as its parameters or the engine do (a closed engine still
reads the weights), and go, with their buffers, at the first garbage collection once the script has dropped the
engine, the model and its optimizer: nothing in a group refers back to it strongly, so it is not left for a second
collection."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import zinf


def _trained() -> tuple[zinf.ZeroInfinityEngine, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with zinf.Init():
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    engine = zinf.initialize(model, opt)
    engine.backward(engine(torch.randn(2, 64)).square().mean())
    engine.step()
    return engine, model, opt


def test_closed_and_dropped_groups_go_at_the_first_collection() -> None:
    engine, model, opt = _trained()
    groups = [weakref.ref(g) for g in engine.groups]
    buffers = [weakref.ref(t) for g in engine.groups for t in (g.master, g.grad.resident) if t is not None]
    assert groups and buffers
    engine.close()
    del engine, model, opt
    gc.collect()
    assert [r() for r in groups] == [None] * len(groups)
    assert [r() for r in buffers] == [None] * len(buffers)


def test_a_closed_engine_still_reads_the_weights_it_holds() -> None:
    engine, model, _ = _trained()
    before = engine.full_state_dict()
    groups = [weakref.ref(g) for g in engine.groups]
    engine.close()
    del model
    gc.collect()
    assert all(r() is not None for r in groups)
    after = engine.full_state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
