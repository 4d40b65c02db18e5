"""Memory-centric operator tiling: a large linear layer run as a grid of smaller ones.

[Note: tiles]
``TiledLinear(in_features, out_features, tiles=(in_splits, out_splits))`` holds a grid of tile modules;
tile ``(o, i)`` owns the block ``W[rows_o, cols_i]`` of the layer's weight as a parameter of its own, so
zinf partitions, gathers, prefetches (through the recorded trace, like any module) and releases every
tile as a group of its own. A tile's hooks gather one tile, so the layer's working memory is a tile
(plus the tiles prefetch brings ahead, within ``overlap.prefetch_bytes`` and ``overlap.max_gathered_bytes``)
instead of the whole weight, in forward and again in backward. The output is
``y[..., rows_o] = sum_i x[..., cols_i] @ W[rows_o, cols_i]^T + b[rows_o]``: autograd gives the input,
weight and bias gradients of ``nn.Linear``; only the order of the sum over input tiles differs (fp32
rounding). The bias is the layer's own parameter, added once. Inputs may arrive split (a sequence of
``in_splits`` tensors) and outputs may leave split (a list of ``out_splits`` tensors), so two tiled
layers in a row need not concatenate between them.

[Note: untiled names]
``state_dict()`` of a tiled layer, the engine's ``full_state_dict()`` and ``zinf consolidate`` present the
layer as ``nn.Linear`` does (``weight`` of shape ``(out, in)`` and ``bias``); ``load_state_dict`` and
``engine.load_full_state_dict`` split an untiled ``weight`` into the tiles. A checkpoint therefore moves
between a tiled and an untiled model in both directions. :func:`tile_spec` records the grid of every
tiled layer so that files alone (no model) can be merged back.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zinf.config_sections import TilingConfig
from zinf.errors import UnsupportedModelError
from zinf.runtime.comm import Comm

__all__ = ["TiledLinear", "LinearTile", "tile_linears", "remap_optimizer", "plan_tiles", "tile_spec", "merge_tiles", "split_tiles"]

log = logging.getLogger(__name__)


def _sizes(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, the first ``total % parts`` one larger (as ``tensor_split``)."""
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


class LinearTile(nn.Module):
    """One tile of a :class:`TiledLinear`: ``x @ weight.T`` for its block of the weight (no bias)."""

    def __init__(self, out_features: int, in_features: int, bound: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        if bound > 0:  # initialised before the tile is attached, so zinf.Init partitions it initialised
            nn.init.uniform_(weight, -bound, bound)
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TiledLinear(nn.Module):
    """``nn.Linear`` as a grid of ``tiles = (in_splits, out_splits)`` tiles gathered one at a time.
    See [Note: tiles]. Initialised as ``nn.Linear`` is (uniform in +-1/sqrt(in_features))."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tiles: Sequence[int] = (1, 1),
                 input_is_split: bool = False, split_output: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 init: bool = True) -> None:
        super().__init__()
        if len(tiles) != 2:
            raise UnsupportedModelError(f"TiledLinear: tiles={tuple(tiles)!r}; pass (input splits, output splits).")
        in_splits, out_splits = int(tiles[0]), int(tiles[1])
        if not (1 <= in_splits <= max(in_features, 1) and 1 <= out_splits <= max(out_features, 1)):
            raise UnsupportedModelError(
                f"TiledLinear({in_features}, {out_features}): tiles=({in_splits}, {out_splits}) is not possible; "
                f"input splits must be in [1, {in_features}] and output splits in [1, {out_features}].")
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes, self.out_sizes = _sizes(in_features, in_splits), _sizes(out_features, out_splits)
        self.input_is_split, self.split_output = input_is_split, split_output
        bound = 1.0 / math.sqrt(in_features) if init and in_features > 0 else 0.0
        self.tiles = nn.ModuleList(LinearTile(o, i, bound, device, dtype) for o in self.out_sizes for i in self.in_sizes)
        if bias:
            b = torch.empty(out_features, device=device, dtype=dtype)
            if bound > 0:
                nn.init.uniform_(b, -bound, bound)
            self.bias = nn.Parameter(b)
        else:
            self.register_parameter("bias", None)
        self.register_state_dict_post_hook(_merge_hook)
        self.register_load_state_dict_pre_hook(_split_hook)

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.in_sizes), len(self.out_sizes)

    def tile(self, o: int, i: int) -> LinearTile:
        return self.tiles[o * len(self.in_sizes) + i]  # type: ignore[return-value]

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        parts = self._split_input(x)
        outs: list[torch.Tensor] = []
        start = 0
        for o, size in enumerate(self.out_sizes):
            acc: torch.Tensor | None = None
            for i, part in enumerate(parts):
                y = self.tile(o, i)(part)
                acc = y if acc is None else acc + y
            assert acc is not None
            if self.bias is not None:
                acc = acc + self.bias[start : start + size]
            start += size
            outs.append(acc)
        return outs if self.split_output else torch.cat(outs, dim=-1)

    def _split_input(self, x: torch.Tensor | Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        if not self.input_is_split:
            if not isinstance(x, torch.Tensor) or x.shape[-1] != self.in_features:
                raise UnsupportedModelError(
                    f"TiledLinear({self.in_features}, {self.out_features}): expected an input whose last dimension is "
                    f"{self.in_features}, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} "
                    "(for an input split into pieces, build it with input_is_split=True).")
            return torch.split(x, self.in_sizes, dim=-1)
        sizes = [t.shape[-1] for t in x]
        if sizes != self.in_sizes:
            raise UnsupportedModelError(f"TiledLinear: the split input has last dimensions {sizes}; this layer's input "
                                        f"tiles are {self.in_sizes}.")
        return x

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy an untiled ``(out, in)`` weight (and bias) into the tiles (unpartitioned layers)."""
        for name, block in split_weight(weight, self.in_sizes, self.out_sizes).items():
            self.tiles[int(name)].weight.copy_(block)
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tiles: Sequence[int]) -> "TiledLinear":
        """A tiled layer holding the same weights as ``linear`` (which must not be partitioned)."""
        w = linear.weight
        tiled = cls(linear.in_features, linear.out_features, linear.bias is not None, tiles=tiles,
                    device=w.device, dtype=w.dtype, init=False)
        tiled.load_weight(w.detach(), None if linear.bias is None else linear.bias.detach())
        for t in tiled.tiles:
            t.weight.requires_grad_(w.requires_grad)
        if linear.bias is not None:
            tiled.bias.requires_grad_(linear.bias.requires_grad)  # type: ignore[union-attr]
        return tiled

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tiles={self.grid}")


# -- names (see [Note: untiled names]) -------------------------------------------------------------------
def split_weight(weight: torch.Tensor, in_sizes: Sequence[int], out_sizes: Sequence[int]) -> dict[str, torch.Tensor]:
    """Tile index (as a string) -> that tile's block of an untiled ``(out, in)`` weight."""
    out: dict[str, torch.Tensor] = {}
    k = 0
    for rows in weight.split(list(out_sizes), dim=0):
        for block in rows.split(list(in_sizes), dim=1):
            out[str(k)] = block.contiguous()
            k += 1
    return out


def tile_spec(model: nn.Module) -> dict[str, dict[str, list[int]]]:
    """The tile grid of every tiled layer of ``model``, by qualified name (kept in checkpoints)."""
    return {name: {"in": list(m.in_sizes), "out": list(m.out_sizes)}
            for name, m in model.named_modules() if isinstance(m, TiledLinear)}


def merge_tiles(state: dict[str, torch.Tensor], spec: dict[str, dict[str, list[int]]], prefix: str = "") -> None:
    """In place: replace each tiled layer's ``tiles.K.weight`` entries by its untiled ``weight``."""
    for name, grid in spec.items():
        base = f"{prefix}{name}." if name else prefix
        count = len(grid["in"]) * len(grid["out"])
        keys = [f"{base}tiles.{k}.weight" for k in range(count)]
        if not all(k in state for k in keys):
            continue
        blocks = [state[k] for k in keys]
        expected = [(o, i) for o in grid["out"] for i in grid["in"]]
        if [tuple(b.shape) for b in blocks] != expected:
            continue  # placeholders of a partitioned layer: nothing to merge
        n_in = len(grid["in"])
        rows = [torch.cat(blocks[r * n_in : (r + 1) * n_in], dim=1) for r in range(len(grid["out"]))]
        for k in keys:
            del state[k]
        state[f"{base}weight"] = torch.cat(rows, dim=0)


def split_tiles(state: dict[str, Any], spec: dict[str, dict[str, list[int]]], prefix: str = "") -> list[str]:
    """In place: replace each tiled layer's untiled ``weight`` by its tiles; returns shape errors."""
    errors = []
    for name, grid in spec.items():
        key = f"{prefix}{name}.weight" if name else f"{prefix}weight"
        if key not in state:
            continue
        weight = state[key]
        shape = (sum(grid["out"]), sum(grid["in"]))
        if tuple(weight.shape) != shape:
            errors.append(f"size mismatch for {key}: the checkpoint has {tuple(weight.shape)}, the tiled layer is {shape}")
            continue
        del state[key]
        for k, block in split_weight(weight, grid["in"], grid["out"]).items():
            state[f"{key[: -len('weight')]}tiles.{k}.weight"] = block
    return errors


def _merge_hook(module: TiledLinear, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    merge_tiles(state, {"": {"in": module.in_sizes, "out": module.out_sizes}}, prefix)


def _split_hook(module: TiledLinear, state: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    error_msgs.extend(split_tiles(state, {"": {"in": module.in_sizes, "out": module.out_sizes}}, prefix))


# -- turning nn.Linear layers into tiled ones ------------------------------------------------------------
def plan_tiles(in_features: int, out_features: int, config: TilingConfig, itemsize: int) -> tuple[int, int]:
    """(input splits, output splits) for one layer: ``config.tiles``, else the fewest tiles (output rows
    first) whose largest weight block holds at most ``config.max_tile_bytes``."""
    if config.tiles:
        return min(config.tiles[0], in_features), min(config.tiles[1], out_features)
    limit = config.max_tile_bytes
    n = max(1, math.ceil(in_features * out_features * itemsize / limit))
    while True:
        out_splits = min(n, out_features)
        in_splits = min(math.ceil(n / out_splits), in_features)
        largest = math.ceil(out_features / out_splits) * math.ceil(in_features / in_splits) * itemsize
        if largest <= limit or (out_splits == out_features and in_splits == in_features):
            return in_splits, out_splits
        n += 1


def tile_linears(model: nn.Module, config: TilingConfig, itemsize: int = 4,
                 comm: Comm | None = None) -> dict[int, list[nn.Parameter]]:
    """Replace every ``nn.Linear`` of ``model`` whose weight has at least ``config.min_numel`` elements by a
    :class:`TiledLinear` with the same weights (partitioned like the layer it replaces, if it was). Returns
    ``id(old parameter) -> its new parameters`` (the weight's tiles; the bias itself) so that an optimizer
    built on the old parameters can be pointed at the new ones. Layers whose weight is shared with another
    module (tied) or also registered elsewhere stay untiled; a partitioned layer is gathered once, alone, through
    ``comm`` (default: the current process group)."""
    if not config.enabled:
        return {}
    from zinf.param.partition import partition_module_params
    from zinf.param.gathered import gather_full_master
    from zinf.param.registry import group_of, unregister

    uses: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    replaced: dict[int, list[nn.Parameter]] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.weight.numel() < config.min_numel or getattr(
                    group_of(child.weight), "quantized", None) is not None:  # 4-bit weights stay as loaded
                continue
            own = [p for p in (child.weight, child.bias) if p is not None]
            if any(uses.get(id(p), 0) > 1 for p in own):
                log.info("zinf: %s shares its weight with another module; left untiled", _join(name, child_name))
                continue
            group = group_of(child.weight)
            if group is not None and any(q is not None and all(q is not p for p in own) for q in group.params):
                log.info("zinf: %s is partitioned with other parameters; left untiled", _join(name, child_name))
                continue
            tiles = plan_tiles(child.in_features, child.out_features, config, itemsize)
            if group is None:
                tiled = TiledLinear.from_linear(child, tiles)
            else:
                comm = comm or Comm.current(device=group.device)
                full = gather_full_master(comm, group)
                values = [full[s.offset : s.offset + s.numel].view(s.shape).clone() for s in group.slots]
                tiled = TiledLinear(child.in_features, child.out_features, child.bias is not None, tiles=tiles,
                                    device=values[0].device, init=False)
                tiled.load_weight(values[0], values[1] if len(values) > 1 else None)
                for t in tiled.tiles:
                    t.weight.requires_grad_(child.weight.requires_grad)
                if child.bias is not None:
                    tiled.bias.requires_grad_(child.bias.requires_grad)  # type: ignore[union-attr]
                for p in own:
                    unregister(p)
                full_name = _join(name, child_name)
                for k, t in enumerate(tiled.tiles):
                    partition_module_params(t, f"{full_name}.tiles.{k}", comm, group.compute_dtype, group.device,
                                            storage_dtype=group.storage_dtype)
                partition_module_params(tiled, full_name, comm, group.compute_dtype, group.device,
                                        storage_dtype=group.storage_dtype)
            setattr(module, child_name, tiled)
            replaced[id(child.weight)] = [t.weight for t in tiled.tiles]  # type: ignore[misc]
            if child.bias is not None:
                replaced[id(child.bias)] = [tiled.bias]  # type: ignore[list-item]
            log.info("zinf: tiled %s (%d x %d) into %d x %d tiles", _join(name, child_name), child.out_features,
                     child.in_features, tiles[0], tiles[1])
    return replaced


def remap_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, list[nn.Parameter]]) -> None:
    """Point ``optimizer``'s param groups at the parameters that replaced tiled layers' ones (same
    hyper-parameters). Must run before the optimizer has state."""
    if not replaced:
        return
    for pg in optimizer.param_groups:
        params: list[nn.Parameter] = []
        for p in pg["params"]:
            params.extend(replaced.get(id(p), [p]))
        pg["params"] = params


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child
