"""The run context: one set of streams per engine (and per ``zinf.Init`` block), built once and handed to every part;
nothing builds streams during steps, and no flat group holds a process group."""

from __future__ import annotations

import pytest
import torch

import zinf
from models import GPT, GPTConfig, batches, make_optimizer
from zinf.runtime import streams as streams_module


@pytest.mark.parametrize("params", ["device", "cpu"])
def test_one_streams_per_engine_over_two_steps(params: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    init = streams_module.Streams.__init__

    def counted(self: streams_module.Streams, device: torch.device) -> None:
        built.append(str(device))
        init(self, device)

    monkeypatch.setattr(streams_module.Streams, "__init__", counted)
    config = zinf.ZeroConfig.from_dict({"offload": {"params": params}} if params != "device" else {})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = GPT(GPTConfig())
    assert built == ["cpu"], "zinf.Init builds one context for the block"
    engine = zinf.initialize(model, make_optimizer(model), config)
    assert len(built) == 2, "the engine builds one context"
    for x, y in batches("gpt", 2, 4):
        engine.backward(engine(x, y))
        engine.step()
    assert len(built) == 2, f"streams built during the steps: {built[2:]}"
    assert engine.ctx.streams is engine.fetcher.ctx.streams is engine.reducer.ctx.streams
    assert all(not hasattr(g, "comm") for g in engine.groups)
    engine.close()
