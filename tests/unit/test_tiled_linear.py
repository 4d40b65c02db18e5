"""TiledLinear against nn.Linear in one process: outputs, every gradient, names, and the tile planner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zinf
from zinf.config import TilingConfig
from zinf.errors import ConfigError, UnsupportedModelError
from zinf.tiling import TiledLinear, plan_tiles, tile_linears

TILES = [(1, 1), (1, 4), (3, 1), (3, 4), (37, 1), (5, 23)]  # uneven: 37 inputs, 23 outputs


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    err = float((a - b).detach().abs().max()) / max(float(b.detach().abs().max()), 1e-12)
    assert err <= rtol, f"relative difference {err:.2e}"


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_matches_linear_in_output_and_every_gradient(tiles: tuple[int, int], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(37, 23, bias=bias)
    tiled = TiledLinear.from_linear(linear, tiles)
    assert tiled.grid == tiles and len(tiled.tiles) == tiles[0] * tiles[1]
    x1 = torch.randn(4, 5, 37, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = linear(x1), tiled(x2)
    _close(y2, y1)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    _close(x2.grad, x1.grad)
    weight_grad = torch.cat([torch.cat([tiled.tile(o, i).weight.grad for i in range(tiles[0])], 1)
                             for o in range(tiles[1])], 0)
    _close(weight_grad, linear.weight.grad)
    if bias:
        _close(tiled.bias.grad, linear.bias.grad)


def test_inputs_may_arrive_split_and_outputs_leave_split() -> None:
    torch.manual_seed(0)
    first = TiledLinear(16, 24, tiles=(2, 3), split_output=True)
    second = TiledLinear(24, 8, tiles=(3, 2), input_is_split=True)
    x = torch.randn(3, 16)
    pieces = first(x)
    assert [p.shape[-1] for p in pieces] == [8, 8, 8]
    plain1, plain2 = nn.Linear(16, 24), nn.Linear(24, 8)
    plain1.load_state_dict(first.state_dict())
    plain2.load_state_dict(second.state_dict())
    _close(second(pieces), plain2(plain1(x)))
    with pytest.raises(UnsupportedModelError, match="split input has last dimensions"):
        second([torch.randn(3, 12), torch.randn(3, 12)])
    with pytest.raises(UnsupportedModelError, match="last dimension is 16"):
        first(torch.randn(3, 15))


@pytest.mark.parametrize("tiles", [(3, 4), (5, 23)])
def test_state_dict_keeps_untiled_names_both_ways(tiles: tuple[int, int]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(37, 23)
    tiled = TiledLinear(37, 23, tiles=tiles)
    assert set(tiled.state_dict()) == {"weight", "bias"} and tiled.state_dict()["weight"].shape == (23, 37)
    tiled.load_state_dict(linear.state_dict())  # untiled -> tiled
    back = nn.Linear(37, 23)
    back.load_state_dict(tiled.state_dict())  # tiled -> untiled
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight.*\(23, 36\)"):
        tiled.load_state_dict({"weight": torch.zeros(23, 36), "bias": torch.zeros(23)})


def test_a_tiled_layer_is_initialised_like_nn_linear() -> None:
    torch.manual_seed(0)
    w = TiledLinear(400, 300, tiles=(4, 3)).state_dict()["weight"]
    bound = 1 / 400**0.5
    assert float(w.abs().max()) <= bound and abs(float(w.std()) - bound / 3**0.5) < 0.02 * bound


@pytest.mark.parametrize("shape,limit", [((64, 64), 4096), ((1000, 10), 4000), ((10, 1000), 4000), ((37, 23), 1000)])
def test_planner_gives_the_fewest_tiles_under_the_byte_limit(shape: tuple[int, int], limit: int) -> None:
    rows, cols = shape  # (out, in)
    i, o = plan_tiles(cols, rows, TilingConfig(min_numel=1, max_tile_bytes=limit), 4)
    largest = -(-rows // o) * -(-cols // i) * 4
    assert largest <= limit
    assert (i * o - 1) * limit < rows * cols * 4 * 2  # no more than about twice the minimum count


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 48)
        self.b.weight = self.a.weight
        self.small = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.c(torch.relu(self.a(x)) + self.b(x)))


def test_tile_linears_replaces_large_layers_and_points_the_optimizer_at_the_tiles() -> None:
    torch.manual_seed(0)
    model = _Tied()
    x = torch.randn(5, 32)
    before = model(x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    replaced = tile_linears(model, TilingConfig(min_numel=1000, tiles=[2, 2]))
    assert isinstance(model.c, TiledLinear)
    assert type(model.a) is nn.Linear and type(model.b) is nn.Linear  # tied: left untiled
    assert type(model.small) is nn.Linear  # 48 * 4 < min_numel
    _close(model(x), before)
    from zinf.tiling import remap_optimizer

    remap_optimizer(opt, replaced)
    assert sorted(id(p) for p in opt.param_groups[0]["params"]) == sorted(id(p) for p in model.parameters())


def test_tiling_and_checkpointing_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="tiling.min_numel.*set one of them"):
        zinf.ZeroConfig.from_dict({"tiling": {"min_numel": 10}})
    with pytest.raises(ConfigError, match="tiling.tiles"):
        zinf.ZeroConfig.from_dict({"tiling": {"min_numel": 10, "tiles": [2]}})
    with pytest.raises(ConfigError, match="Did you mean 'tiling.max_tile_bytes'"):
        zinf.ZeroConfig.from_dict({"tiling": {"max_tile_byte": 10}})
    with pytest.raises(ConfigError, match="activation_checkpointing.modules"):
        zinf.ZeroConfig.from_dict({"activation_checkpointing": {"modules": "Block"}})
    with pytest.raises(ConfigError, match="overlap.max_gathered_bytes"):
        zinf.ZeroConfig.from_dict({"overlap": {"max_gathered_bytes": -1}})
    with pytest.raises(UnsupportedModelError, match=r"tiles=\(0, 2\) is not possible"):
        TiledLinear(4, 4, tiles=(0, 2))
