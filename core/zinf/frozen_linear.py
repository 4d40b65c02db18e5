"""Frozen linear layers computed from their stored weights, a tile of output rows at a time.

[Note: frozen linears from storage]
A LoRA base stored in bf16 and computed in fp32 on a CPU (which has no fast bf16 matmul) is widened whole on every
gather: the fp32 copy of each weight is written to memory and read back by the matmul, twice a step; and torch's
matmul of a short input (64 tokens) by a weight far larger than the cache runs below the square-matrix rate. With
``tiling.frozen_tile_bytes`` set, the engine gathers each such layer's group at its storage width
(``FlatParamGroup.keep_narrow``: half the bytes gathered, kept and moved) and the layer's forward multiplies a tile
of output rows at a time: the tile's rows are widened into a buffer of about ``frozen_tile_bytes``, small enough to
stay in the core's cache, and multiplied from there. Its backward computes the input's gradient the same way (the
weight has none). docs/tiling.md has the measured rates (``benchmarks/bench_frozen_linear.py``). Values: each output
element is the same dot product over the whole input row, but torch's kernel for a tile may round in another order
than for the whole weight (fp32 rounding, about 1e-7 relative); the input's gradient sums the tiles in order. Which
layers: exactly ``nn.Linear`` (a subclass may read its weight itself) with no forward of another wrapper on the
instance, on a CPU, whose weight and bias are frozen when the engine is built, stored in bf16 or fp16 for an fp32
compute, not quantized, not shared with another module, and the only parameters of their group. While such a layer
is gathered its parameters are the stored 16-bit tensors (the bias is added widened).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.registry import group_of

__all__ = ["compute_from_storage", "restore", "tile_rows", "linear_in_tiles"]

log = logging.getLogger("zinf")

_NARROW = (torch.bfloat16, torch.float16)


def tile_rows(in_features: int, tile_bytes: int) -> int:
    """Rows of fp32 weight in one tile of about ``tile_bytes``: a multiple of 16 (the vector width), at least 16."""
    return max(16, tile_bytes // (4 * max(in_features, 1)) // 16 * 16)


def linear_in_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``F.linear(x, weight.to(x.dtype), bias)`` with ``weight`` widened ``rows`` output rows at a time."""
    return _TiledLinear.apply(x, weight, bias, rows)


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                rows: int) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.rows = rows
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features)
        y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
        tile = torch.empty(min(rows, out_features), in_features, dtype=x.dtype, device=x.device)
        for lo in range(0, out_features, rows):
            t = tile[: min(rows, out_features - lo)]
            t.copy_(weight[lo : lo + t.shape[0]])  # torch's copy: ordinary stores leave the tile in the cache
            torch.mm(x2, t.T, out=y[:, lo : lo + t.shape[0]])
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (weight,) = ctx.saved_tensors
        rows = ctx.rows
        out_features, in_features = weight.shape
        g2 = grad.reshape(-1, out_features)
        dx = torch.empty(g2.shape[0], in_features, dtype=grad.dtype, device=grad.device)
        tile = torch.empty(min(rows, out_features), in_features, dtype=grad.dtype, device=grad.device)
        for lo in range(0, out_features, rows):
            t = tile[: min(rows, out_features - lo)]
            t.copy_(weight[lo : lo + t.shape[0]])
            if lo == 0:
                torch.mm(g2[:, : t.shape[0]], t, out=dx)
            else:
                dx.addmm_(g2[:, lo : lo + t.shape[0]], t)
        return dx.view(*grad.shape[:-1], in_features), None, None, None


def _forward(self: nn.Linear, rows: int, x: torch.Tensor) -> torch.Tensor:
    # frozen: the engine refuses a forward once requires_grad changed after it was built
    if x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype not in _NARROW:
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
    return linear_in_tiles(x, self.weight, self.bias, rows)


def _eligible(module: nn.Module, owners: dict[int, int]) -> FlatParamGroup | None:
    """The group ``module`` alone owns, frozen and stored narrower than fp32 on a CPU; else None."""
    if type(module) is not nn.Linear or "forward" in module.__dict__:  # not another wrapper's (accelerate's hooks)
        return None
    group = group_of(module.weight)
    own = [p for p in (module.weight, module.bias) if p is not None]
    if (group is None or group.trainable or group.state is not GroupState.SHARDED or group.quantized is not None or group.compute_dtype != torch.float32
            or group.storage_dtype not in _NARROW or group.device.type != "cpu" or any(owners[id(p)] > 1 for p in own)):
        return None
    members = {id(p) for p in group.params if p is not None}
    return group if members == {id(p) for p in own} else None


def compute_from_storage(model: nn.Module, tile_bytes: int) -> list[nn.Linear]:
    """Switch every eligible frozen ``nn.Linear`` of ``model`` to gathering narrow and computing in tiles of about
    ``tile_bytes`` ([Note: frozen linears from storage]); returns them (``restore`` undoes it). 0: none."""
    if tile_bytes <= 0:
        return []
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    switched = []
    for module in model.modules():
        group = _eligible(module, owners)
        if group is None:
            continue
        group.keep_narrow()
        module.forward = functools.partial(_forward, module, tile_rows(module.in_features, tile_bytes))  # type: ignore[method-assign]
        switched.append(module)
    if switched:
        log.info("zinf: %d frozen linear layers (%.2f GiB stored) gathered at their storage width, computed in tiles of "
                 "%d KiB", len(switched), sum(group_of(m.weight).numel for m in switched) * 2 / 2**30, tile_bytes >> 10)
    return switched


def restore(modules: list[nn.Linear]) -> None:
    """The layers' own forward again (the engine is closed; their groups go with it)."""
    for module in modules:
        module.__dict__.pop("forward", None)
        group = group_of(module.weight)
        if group is not None and group.state is GroupState.SHARDED:
            group.keep_narrow(False)
