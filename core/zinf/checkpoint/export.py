"""Export a running engine's model as Hugging Face style safetensors files, one group in memory at a time.

The files, their names, the shard planning and the tied-weight handling are those of every model export (see
[Note: model files] in zinf/checkpoint/shard_writer.py). Tensor names are the ``state_dict`` names of
``engine.module`` (``prefix`` stripped); persistent buffers come after the parameters. A tiled layer
(zinf/tiling.py) is written as its untiled ``weight``, assembled on rank 0 from its tiles' groups.

Every rank gathers the fp32 masters group by group; rank 0 writes each tensor into its shard as it comes (a
shard is renamed into place as soon as it is complete). Peak memory is one gathered group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zinf.checkpoint.model_state import slot_views
from zinf.checkpoint.safetensors_header import TensorSpec
from zinf.checkpoint.shard_writer import SAFETENSORS, ShardPlan, ShardWriter, parse_size, plan_shards
from zinf.checkpoint.source import ModelSource
from zinf.errors import ZinfError
from zinf.tiling import TiledLinear
from zinf.param.gathered import gather_full_master

__all__ = ["save_safetensors", "parse_size"]

log = logging.getLogger("zinf")

SINGLE = SAFETENSORS.single
INDEX = SAFETENSORS.index


@dataclass
class _Sources:
    """Where each planned tensor comes from in the live engine."""

    params: dict[int, str] = field(default_factory=dict)  # id(parameter) -> the name it is written under
    tile_index: dict[int, int] = field(default_factory=dict)  # id(tile weight) -> its index in its layer
    grids: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # merged name -> (in, out) sizes
    buffers: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def _plan(engine: ModelSource, limit: int, prefix: str,
          dtype: torch.dtype | None) -> tuple[_Sources, ShardPlan]:
    """Names and shapes of every tensor to write, in writing order (groups, then buffers), and their shards."""

    def strip(name: str) -> str:
        return name[len(prefix):] if prefix and name.startswith(prefix) else name

    names: dict[int, list[str]] = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(strip(n))
    # persistent buffers, found without state_dict() (which a front end may refuse on a partitioned model)
    persistent = {f"{mn}.{bn}" if mn else bn for mn, m in engine.module.named_modules(remove_duplicate=False)
                  for bn, b in m._buffers.items() if b is not None and bn not in m._non_persistent_buffers_set}
    buffer_names: dict[int, list[str]] = {}
    buffer_of: dict[int, torch.Tensor] = {}
    for n, b in engine.module.named_buffers(remove_duplicate=False):
        if n in persistent:
            buffer_names.setdefault(id(b), []).append(strip(n))
            buffer_of[id(b)] = b

    sources, specs, tied = _Sources(), [], {}
    tiles: dict[int, tuple[str, int]] = {}  # a tiled layer's weight is written whole (see zinf/tiling.py)
    merged_specs: dict[str, TensorSpec] = {}
    for mn, m in engine.module.named_modules():
        if isinstance(m, TiledLinear):
            merged = strip(f"{mn}.weight" if mn else "weight")
            merged_specs[merged] = TensorSpec(merged, torch.float32, (m.out_features, m.in_features))
            sources.grids[merged] = (list(m.in_sizes), list(m.out_sizes))
            tiles.update((id(t.weight), (merged, k)) for k, t in enumerate(m.tiles))
    for g in engine.groups:
        for p, slot in zip(g.params, g.slots):
            if p is None or id(p) not in names or id(p) in sources.params:
                continue
            if id(p) in tiles:
                merged, k = tiles[id(p)]
                if merged_specs[merged] not in specs:
                    specs.append(merged_specs[merged])
                sources.params[id(p)], sources.tile_index[id(p)] = merged, k
                continue
            sources.params[id(p)] = names[id(p)][0]
            specs.append(TensorSpec(names[id(p)][0], torch.float32, slot.shape))
            tied.update((alias, names[id(p)][0]) for alias in names[id(p)][1:])
    for bid, bnames in buffer_names.items():
        b = buffer_of[bid]
        sources.buffers.append((bnames[0], b))
        specs.append(TensorSpec(bnames[0], b.dtype, b.shape))
        tied.update((alias, bnames[0]) for alias in bnames[1:])
    hint = f" (prefix={prefix!r}) Pass a prefix that only the model's own names start with."
    try:
        return sources, plan_shards(specs, tied, limit, dtype, duplicate_hint=hint)
    except ValueError as exc:
        raise ValueError(f"save_safetensors: {exc}") from None


def _agree(engine: ModelSource, error: BaseException | None, what: str) -> None:
    """Raise on every rank when rank 0 failed (``error``), so no rank is left waiting in a collective."""
    failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=engine.comm.device)
    engine.comm.broadcast(failed, src=0)
    if error is not None:
        raise error
    if int(failed.item()):
        raise ZinfError(f"save_safetensors: rank 0 failed while {what}; see its error.")


def save_safetensors(engine: ModelSource, directory: str | os.PathLike, *, max_shard_size: int | str = "10GB",
                     prefix: str | None = None, dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``engine``'s model to ``directory`` as Hugging Face safetensors (sharded above ``max_shard_size``).

    Collective: every rank must call it. Only rank 0 writes; it returns the paths written (shards, then
    the index when there is one), the other ranks ``[]``. ``dtype`` (e.g. ``torch.bfloat16``) casts the
    fp32 master weights and floating-point buffers; ``None`` keeps them as they are.
    """
    limit = parse_size(max_shard_size)
    prefix = engine.name_prefix if prefix is None else prefix
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"save_safetensors: dtype={dtype!r} is not a floating-point torch.dtype. "
                         "Pass e.g. torch.bfloat16, torch.float16, or None to keep fp32.")
    directory = Path(directory)
    rank0 = engine.comm.rank == 0
    sources, plan = _plan(engine, limit, prefix, dtype)

    error: BaseException | None = None
    if rank0:
        try:
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"save_safetensors: {str(directory)!r} exists and is not a directory. "
                                 "Pass a directory path (it is created when missing).")
            directory.mkdir(parents=True, exist_ok=True)
            SAFETENSORS.clear(directory)
        except Exception as exc:  # noqa: BLE001 - re-raised by _agree
            error = exc
    _agree(engine, error, f"preparing {directory}")

    writer = ShardWriter(plan, directory) if rank0 else None

    def add(name: str, value: torch.Tensor) -> None:
        """Rank 0 remembers its first error instead of raising, so every rank keeps taking part in the gathers
        and all of them fail together at the end."""
        nonlocal error
        if error is None:
            try:
                writer.add(name, value)
            except Exception as exc:  # noqa: BLE001 - re-raised by _agree
                error = exc

    assembling: dict[str, dict[int, torch.Tensor]] = {}  # a tiled layer's tiles until the last one arrives
    with torch.no_grad():
        for g in engine.groups:
            full = gather_full_master(engine.comm, g, engine.master_of(g))
            if writer is None:
                continue
            for index, value in slot_views(full, [(s.offset, s.shape) for s in g.slots]):
                p = g.params[index]
                name = sources.params.get(id(p)) if p is not None else None
                if name is None:
                    continue
                if id(p) in sources.tile_index:
                    parts = assembling.setdefault(name, {})
                    parts[sources.tile_index[id(p)]] = value.to("cpu", copy=True)
                    ins, outs = sources.grids[name]
                    if len(parts) < len(ins) * len(outs):
                        continue
                    del assembling[name]
                    value = torch.cat([torch.cat([parts[o * len(ins) + i] for i in range(len(ins))], 1)
                                       for o in range(len(outs))], 0)
                add(name, value)
            del full
        if writer is not None:
            for name, b in sources.buffers:
                add(name, b)
            if error is None:
                try:
                    writer.finish()
                except Exception as exc:  # noqa: BLE001
                    error = exc
            if error is not None:
                writer.abort()
    _agree(engine, error, f"writing {directory}")

    if writer is None:
        return []
    log.info("zinf: exported %d safetensors file(s), %d bytes, to %s", len(writer.files), plan.total_bytes, directory)
    return writer.written
