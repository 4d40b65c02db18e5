"""Frozen linear layers computed from their stored weights, a tile of output rows at a time.

[Note: frozen linears from storage]
A LoRA base stored in bf16 and computed in fp32 on a CPU (which has no fast bf16 matmul) is widened whole on every
gather, and a quantized base (4 or 8 bits) decoded whole: the fp32 copy of each weight is written to memory and read
back by the matmul, twice a step; and torch's matmul of a short input (64 tokens) by a weight far larger than the
cache runs below the square-matrix rate. With ``tiling.frozen_tile_bytes`` set, the engine gathers each such layer's
group at its storage width (``FlatParamGroup.keep_narrow``: a 16-bit group as 16-bit values, a quantized one as its
shards' codes and scales end to end, ``packed``) and the layer's forward multiplies a tile of output rows at a time:
the tile's rows are widened or decoded (``WeightRows``; the formats' ``decode_range``) into a buffer of about
``frozen_tile_bytes``, small enough to stay in the core's cache, and multiplied from there. Its backward computes the
input's gradient the same way (the weight has none). docs/tiling.md has the measured rates
(``benchmarks/bench_frozen_linear.py``).

Values: each tile holds exactly the values the whole widening or decoding gives; each output element is the same
dot product over the whole input row, but torch's kernel for a tile may round in another order than for the whole
weight (fp32 rounding, about 1e-7 relative); the input's gradient sums the tiles in order.

Which layers: exactly ``nn.Linear`` (a subclass may read its weight itself) with no forward of another wrapper on the
instance, on a CPU, computing in fp32, whose weight is frozen when the engine is built and not shared with another
module, and either stored in bf16 or fp16 with its bias as the only parameters of their group, or quantized (the
weight alone; in 4 bits only where each row is whole blocks). While a 16-bit layer is gathered its parameters are
the stored 16-bit tensors (the bias is added widened); a packed group's weight stays its placeholder, and
``GatheredParameters`` decodes it whole for code that reads it (zinf/param/gathered.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from zinf.param.eight_bit import QuantizedFormat
from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.registry import group_of

__all__ = ["compute_from_storage", "restore", "tile_rows", "linear_in_tiles", "WeightRows"]

log = logging.getLogger("zinf")

_NARROW = (torch.bfloat16, torch.float16)


def tile_rows(in_features: int, tile_bytes: int) -> int:
    """Rows of fp32 weight in one tile of about ``tile_bytes``: a multiple of 16 (the vector width), at least 16."""
    return max(16, tile_bytes // (4 * max(in_features, 1)) // 16 * 16)


class WeightRows:
    """The rows of a weight, widened or decoded into a tile when asked: ``fill(lo, tile)`` writes rows ``[lo, lo +
    len(tile))`` in fp32 (``tile`` contiguous). The source is read then: in the backward, gathered again."""

    def __init__(self, shape: Sequence[int], fill: Callable[[int, torch.Tensor], Any]) -> None:
        self.shape, self.fill = torch.Size(shape), fill

    @classmethod
    def widened(cls, weight: torch.Tensor) -> "WeightRows":
        """From a 16-bit ``weight`` (torch's copy: ordinary stores leave the tile in the cache)."""
        return cls(weight.shape, lambda lo, tile: tile.copy_(weight[lo : lo + tile.shape[0]]))

    @classmethod
    def decoded(cls, shape: Sequence[int], fmt: QuantizedFormat, shards: torch.Tensor, world: int, shard_numel: int,
                offset: int) -> "WeightRows":
        """From the weight at flat ``offset`` of the codes ``world`` shards of ``shard_numel`` elements hold end to end
        (``shards``: a packed group's gather buffer, or one shard), in ``fmt`` (its ``decode_range``)."""
        k = shape[1]
        return cls(shape, lambda lo, tile: fmt.decode_range(shards, world, shard_numel, offset + lo * k,
                                                            offset + (lo + tile.shape[0]) * k, tile.view(-1)))


def linear_in_tiles(x: torch.Tensor, weight: torch.Tensor | WeightRows, bias: torch.Tensor | None,
                    rows: int) -> torch.Tensor:
    """``F.linear(x, weight.to(x.dtype), bias)`` with the weight widened (or decoded) ``rows`` output rows at a time;
    no gradient for the weight."""
    source = weight if isinstance(weight, WeightRows) else WeightRows.widened(weight)
    return _TiledLinear.apply(x, bias, rows, source)


def _tiles(source: WeightRows, rows: int, like: torch.Tensor):  # type: ignore[no-untyped-def]
    out_features, in_features = source.shape
    tile = torch.empty(min(rows, out_features), in_features, dtype=like.dtype, device=like.device)
    for lo in range(0, out_features, rows):
        t = tile[: min(rows, out_features - lo)]
        source.fill(lo, t)
        yield lo, t


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, rows: int,  # type: ignore[override]
                source: WeightRows) -> torch.Tensor:
        ctx.rows, ctx.source = rows, source
        out_features, in_features = source.shape
        x2 = x.reshape(-1, in_features)
        y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
        for lo, t in _tiles(source, rows, x):
            torch.mm(x2, t.T, out=y[:, lo : lo + t.shape[0]])
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        out_features, in_features = ctx.source.shape
        g2 = grad.reshape(-1, out_features)
        dx = torch.empty(g2.shape[0], in_features, dtype=grad.dtype, device=grad.device)
        for lo, t in _tiles(ctx.source, ctx.rows, grad):
            if lo == 0:
                torch.mm(g2[:, : t.shape[0]], t, out=dx)
            else:
                dx.addmm_(g2[:, lo : lo + t.shape[0]], t)
        return dx.view(*grad.shape[:-1], in_features), None, None, None


def _forward(self: nn.Linear, rows: int, codes: WeightRows | None, x: torch.Tensor) -> torch.Tensor:
    # frozen: the engine refuses a forward once requires_grad changed after it was built
    if codes is not None:  # no weight but its codes: computed in fp32, in tiles
        bias = None if self.bias is None else self.bias.float()
        return linear_in_tiles(x.float(), codes, bias, rows).to(x.dtype)
    if x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype not in _NARROW:
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
    return linear_in_tiles(x, WeightRows.widened(self.weight), self.bias, rows)


def _eligible(module: nn.Module, owners: dict[int, int]) -> FlatParamGroup | None:
    """The group ``module`` owns alone, frozen, on a CPU, computed in fp32 and stored in 16 bits (with the bias) or
    quantized (the weight alone, in whole blocks a row); else None."""
    if type(module) is not nn.Linear or "forward" in module.__dict__:  # not another wrapper's (accelerate's hooks)
        return None
    group = group_of(module.weight)
    own = [p for p in (module.weight, module.bias) if p is not None]
    if (group is None or group.trainable or group.state is not GroupState.SHARDED or group.compute_dtype != torch.float32
            or group.device.type != "cpu" or any(owners[id(p)] > 1 for p in own)):
        return None
    members = {id(p) for p in group.params if p is not None}
    if group.quantized is not None:
        whole_blocks = module.in_features % group.quantized.align == 0  # a tile's rows start on a block
        return group if whole_blocks and members == {id(module.weight)} else None
    return group if group.storage_dtype in _NARROW and members == {id(p) for p in own} else None


def compute_from_storage(model: nn.Module, tile_bytes: int) -> list[nn.Linear]:
    """Switch every eligible frozen ``nn.Linear`` of ``model`` to gathering narrow and computing in tiles of about
    ``tile_bytes`` ([Note: frozen linears from storage]); returns them (``restore`` undoes it). 0: none."""
    if tile_bytes <= 0:
        return []
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    switched, stored = [], 0
    for module in model.modules():
        group = _eligible(module, owners)
        if group is None:
            continue
        group.keep_narrow()
        codes = None if not group.packed else WeightRows.decoded(
            module.weight.shape, group.format, group.full, group.world, group.shard_numel,  # type: ignore[arg-type]
            group.slots[group.index_of(module.weight)].offset)
        module.forward = functools.partial(_forward, module, tile_rows(module.in_features, tile_bytes), codes)  # type: ignore[method-assign]
        switched.append(module)
        stored += group.world * group.shard_nbytes
    if switched:
        log.info("zinf: %d frozen linear layers (%.2f GiB stored) gathered at their storage width, computed in tiles of "
                 "%d KiB", len(switched), stored / 2**30, tile_bytes >> 10)
    return switched


def restore(modules: list[nn.Linear]) -> None:
    """The layers' own forward again (the engine is closed; their groups go with it)."""
    for module in modules:
        module.__dict__.pop("forward", None)
        group = group_of(module.weight)
        if group is not None and group.state is GroupState.SHARDED:
            group.keep_narrow(False)
