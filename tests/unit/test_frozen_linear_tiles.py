"""Frozen linear layers computed from their 16-bit stored weights a tile of rows at a time (zinf/frozen_linear.py), in
one process: outputs and input gradients against ``F.linear`` on the widened weight, the tile rule, which layers a
model switches, and the setting's check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zinf
from zinf.errors import ConfigError
from zinf.frozen_linear import linear_in_tiles, tile_rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [16, 32, 1024])  # several tiles with a short last one; one tile
@pytest.mark.parametrize("bias", [True, False])
def test_tiles_equal_the_widened_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(53, 37, generator=g).to(dtype)
    b = torch.randn(53, generator=g).to(dtype) if bias else None
    x1 = torch.randn(3, 5, 37, generator=g, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    want = nn.functional.linear(x1, weight.float(), None if b is None else b.float())
    got = linear_in_tiles(x2, weight, b, rows)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert _rel(got, want) <= 1e-6
    grad = torch.randn(want.shape, generator=g)
    want.backward(grad)
    got.backward(grad)
    assert _rel(x2.grad, x1.grad) <= 1e-6


def test_no_input_gradient_when_the_input_needs_none() -> None:
    weight = torch.randn(40, 24).bfloat16()
    y = linear_in_tiles(torch.randn(4, 24), weight, None, 16)
    assert not y.requires_grad


def test_tile_rows_fit_the_bytes_in_multiples_of_16() -> None:
    assert tile_rows(5120, 4 << 20) == 192  # 4 MiB / (5120 x 4 bytes) = 204.8, down to a multiple of 16
    assert tile_rows(2048, 4 << 20) == 512
    assert tile_rows(1 << 20, 4 << 20) == 16  # never fewer than 16 rows
    assert all(tile_rows(k, 1 << 20) % 16 == 0 for k in (7, 100, 3000))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 24)
        self.base = nn.Linear(24, 40)
        self.adapter = nn.Linear(24, 40, bias=False)
        self.head = nn.Linear(40, 10, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.base(h) + self.adapter(h))


def _engine(tile_bytes: int) -> tuple[nn.Module, zinf.ZeroInfinityEngine]:
    config = zinf.ZeroConfig.from_dict({"param_storage": "bf16", "tiling": {"frozen_tile_bytes": tile_bytes}})
    with zinf.Init(config):
        model = _Net()
    model.embed.requires_grad_(False)
    model.base.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, zinf.initialize(model, torch.optim.SGD(trained, lr=0.1), config)


def test_only_frozen_linears_are_switched_and_gathered_narrow() -> None:
    model, engine = _engine(4 << 20)
    try:
        assert engine.from_storage == [model.base]  # the adapter and head train; the embedding is no nn.Linear
        seen = []
        model.base.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        engine(torch.tensor([[1, 2, 3]])).sum().backward()
        assert seen == [torch.bfloat16]  # gathered at the storage width
    finally:
        engine.close()
    assert "forward" not in model.base.__dict__  # closing gives the layer its own forward back


def test_off_by_default_and_checked() -> None:
    model, engine = _engine(0)
    try:
        assert engine.from_storage == []
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="tiling.frozen_tile_bytes"):
        zinf.ZeroConfig.from_dict({"tiling": {"frozen_tile_bytes": -1}})
