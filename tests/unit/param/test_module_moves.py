"""``model.to(...)`` on a partitioned model ([Note: moving a partitioned model] in zinf/param/module_moves.py): a
move that keeps zinf's parameters where they are copies nothing (transformers' Trainer moves the model to
``cpu:0``, and torch copies a ``cpu`` tensor to ``cpu:0``); buffers still move; a cast or a move elsewhere is
refused with the setting that does it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zinf
from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import GroupState
from zinf.param.registry import group_of


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 8)
        self.register_buffer("scale", torch.ones(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.scale


def _built(**overlap: int) -> tuple[nn.Module, "zinf.ZeroInfinityEngine"]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": overlap}) if overlap else zinf.ZeroConfig()
    with zinf.Init(config):
        model = _WithBuffer()
    return model, zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _datas(model: nn.Module) -> list[tuple[int, tuple[int, ...]]]:
    return [(p.data_ptr(), p.stride()) for p in model.parameters()]


def test_a_move_to_where_the_parameters_are_copies_nothing_and_training_goes_on() -> None:
    model, engine = _built()
    torch.manual_seed(1)
    x = torch.randn(4, 256)
    before = _datas(model)
    for move in (lambda m: m.to("cpu:0"), lambda m: m.to(torch.device("cpu", 0)), nn.Module.cpu,
                 lambda m: m.to(torch.float32), lambda m: m.to("cpu", torch.float32)):
        assert move(model) is model
        assert _datas(model) == before  # the placeholders themselves: zero strides, no dense copy
        assert all(p.stride() == (0,) * p.dim() for p in model.parameters())
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_buffers_are_converted_as_torch_converts_them() -> None:
    model, _ = _built()
    buffer = model.scale.data_ptr()
    model.to("cpu:0")
    assert model.scale.data_ptr() != buffer  # torch copies a cpu tensor to cpu:0; zinf leaves buffers to torch
    with pytest.raises(UnsupportedModelError):
        model.half()
    assert model.scale.dtype == torch.float64  # refused before anything was converted


def test_a_persistent_group_stays_the_engines_buffer() -> None:
    """A gathered group's parameters are views of the buffer the optimizer updates; a copy of them would be a
    model the engine no longer trains."""
    model, engine = _built(persistent_numel=1 << 20)
    groups = {id(group_of(p)): group_of(p) for p in model.parameters()}
    assert all(g.persistent and g.state is GroupState.GATHERED for g in groups.values())
    before = _datas(model)
    model.to("cpu:0")
    assert _datas(model) == before
    weight = model.a.weight.detach().clone()
    engine.backward(engine(torch.randn(4, 256)).sum())
    engine.step()
    assert not torch.equal(model.a.weight.detach(), weight), "the model's parameters are the updated buffer"


@pytest.mark.parametrize(("move", "says"), [
    (lambda m: m.half(), "precision"),
    (lambda m: m.to(torch.bfloat16), "precision"),
    (lambda m: m.to("meta"), "zinf.Init"),
])
def test_a_cast_or_a_move_elsewhere_is_refused_with_the_fix(move, says: str) -> None:
    model, _ = _built()
    before = _datas(model)
    with pytest.raises(UnsupportedModelError, match=says):
        move(model)
    assert _datas(model) == before


def test_models_zinf_does_not_hold_move_as_before() -> None:
    model = nn.Linear(4, 4)
    model.to(torch.float64)
    assert model.weight.dtype == torch.float64
