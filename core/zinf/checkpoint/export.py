"""Export an engine's model as Hugging Face style safetensors files, one group in memory at a time.

Layout of the export directory (the names ``transformers`` and ``accelerate`` read)::

    model.safetensors                          everything fits in ``max_shard_size``
    model-00001-of-00003.safetensors  ...      or: several shards
    model.safetensors.index.json               {"metadata": {"total_size": bytes, ...}, "weight_map": {name: file}}

Tensor names are the ``state_dict`` names of ``engine.module`` (``prefix`` stripped). A parameter
reachable under several names (tied weights) is written once, under its first name, because safetensors
refuses shared storage; the other names go in the metadata key ``zinf_tied`` (the index's, or the single
file's) as a JSON string mapping alias -> kept name. Persistent buffers come after the parameters. A tiled
layer (zinf/tiling.py) is written as its untiled ``weight``, assembled on rank 0 from its tiles' groups.

Shards are planned up front from names and sizes (greedy, as ``transformers`` does: a new shard starts
when the next tensor would overflow the limit, so a tensor larger than the limit sits alone). Then every
rank gathers the fp32 masters group by group; rank 0 fills the current shard and writes it (temporary
name, then ``os.replace``) as soon as it is complete. Peak memory is one gathered group plus one shard.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zinf.checkpoint.model_state import slot_views
from zinf.errors import ZinfError
from zinf.tiling import TiledLinear

if TYPE_CHECKING:
    from zinf.engine import ZeroInfinityEngine

__all__ = ["save_safetensors", "parse_size"]

log = logging.getLogger("zinf")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, argument: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"500KB"``, ``"5MB"``, ``"10GB"`` (powers of 1000) or ``"1GiB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        size = -1
    if size <= 0:
        raise ValueError(f"save_safetensors: {argument}={value!r} is not a size. Pass a positive int number of bytes "
                         "or a string like '500KB', '5MB', '10GB' (powers of 1000) or '512MiB', '1GiB' (powers of 1024).")
    return size


@dataclass
class _Entry:
    name: str  # the kept (prefix-stripped) name
    dtype: torch.dtype  # as written
    nbytes: int
    shard: int = -1


@dataclass
class _Plan:
    params: dict[int, _Entry] = field(default_factory=dict)  # id(parameter) -> entry
    buffers: list[tuple[_Entry, torch.Tensor]] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> kept name
    tile_index: dict[int, int] = field(default_factory=dict)  # id(tile weight) -> its index in its layer
    grids: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # merged name -> (in, out) sizes
    shard_sizes: list[int] = field(default_factory=list)
    shard_counts: list[int] = field(default_factory=list)


def _plan(engine: "ZeroInfinityEngine", limit: int, prefix: str, dtype: torch.dtype | None) -> _Plan:
    """Names, sizes and shard of every tensor to write, in writing order (groups, then buffers)."""

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

    plan, order = _Plan(), []
    param_dtype = dtype if dtype is not None else torch.float32
    tiles: dict[int, tuple[_Entry, int]] = {}  # a tiled layer's weight is written whole (see zinf/tiling.py)
    for mn, m in engine.module.named_modules():
        if isinstance(m, TiledLinear):
            merged = _Entry(strip(f"{mn}.weight" if mn else "weight"), param_dtype,
                            m.in_features * m.out_features * param_dtype.itemsize)
            plan.grids[merged.name] = (list(m.in_sizes), list(m.out_sizes))
            tiles.update((id(t.weight), (merged, k)) for k, t in enumerate(m.tiles))
    for g in engine.groups:
        for p, slot in zip(g.params, g.slots):
            if p is None or id(p) not in names or id(p) in plan.params:
                continue
            if id(p) in tiles:
                merged, k = tiles[id(p)]
                if merged not in order:
                    order.append(merged)
                plan.params[id(p)], plan.tile_index[id(p)] = merged, k
                continue
            entry = _Entry(names[id(p)][0], param_dtype, slot.numel * param_dtype.itemsize)
            plan.params[id(p)] = entry
            plan.tied.update((alias, entry.name) for alias in names[id(p)][1:])
            order.append(entry)
    for bid, bnames in buffer_names.items():
        b = buffer_of[bid]
        out = dtype if dtype is not None and b.is_floating_point() else b.dtype
        entry = _Entry(bnames[0], out, b.numel() * out.itemsize)
        plan.buffers.append((entry, b))
        plan.tied.update((alias, entry.name) for alias in bnames[1:])
        order.append(entry)

    seen: set[str] = set()
    for entry in order:
        if entry.name in seen:
            raise ValueError(f"save_safetensors: two different tensors would both be saved as {entry.name!r} "
                             f"(prefix={prefix!r}). Pass a prefix that only the model's own names start with.")
        seen.add(entry.name)
        if not plan.shard_sizes or plan.shard_sizes[-1] + entry.nbytes > limit:
            plan.shard_sizes.append(0)
            plan.shard_counts.append(0)
        entry.shard = len(plan.shard_sizes) - 1
        plan.shard_sizes[-1] += entry.nbytes
        plan.shard_counts[-1] += 1
    if not plan.shard_sizes:  # a model with no tensors still gets its (empty) file
        plan.shard_sizes, plan.shard_counts = [0], [0]
    return plan


def _file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _clear_stale(directory: Path) -> None:
    """Remove what an earlier export (or a crashed one's temporary files) left in ``directory``."""
    stale = [*directory.glob("model-*-of-*.safetensors"), directory / SINGLE, directory / INDEX,
             *directory.glob("model-*-of-*.safetensors.tmp"), directory / f"{SINGLE}.tmp", directory / f"{INDEX}.tmp"]
    for path in stale:
        if path.is_file():
            path.unlink()


class _Writer:
    """Rank 0's side: fills shards, writes each when complete; remembers the first error instead of raising,
    so that every rank keeps taking part in the gathers and all of them fail together at the end."""

    def __init__(self, directory: Path, plan: _Plan) -> None:
        self.directory, self.plan = directory, plan
        self.files = _file_names(len(plan.shard_sizes))
        self.pending: list[dict[str, torch.Tensor]] = [{} for _ in self.files]
        self.written: list[Path] = []
        self.done: set[int] = set()
        self.error: BaseException | None = None
        self.tied_json = json.dumps(plan.tied, sort_keys=True) if plan.tied else None

    def add(self, entry: _Entry, value: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            shard = self.pending[entry.shard]
            shard[entry.name] = value
            if len(shard) == self.plan.shard_counts[entry.shard]:
                self._write_shard(entry.shard)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by save_safetensors
            self.error = exc

    def _write_shard(self, index: int) -> None:
        from safetensors.torch import save_file

        metadata = {"format": "pt"}
        if len(self.files) == 1 and self.tied_json is not None:
            metadata["zinf_tied"] = self.tied_json
        final = self.directory / self.files[index]
        tmp = final.with_name(final.name + ".tmp")
        save_file(self.pending[index], str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600 files; exported models are for others to read
        os.replace(tmp, final)  # a crash mid-write never leaves a file that looks complete
        self.pending[index] = {}  # free the shard's tensors
        self.done.add(index)
        self.written.append(final)

    def finish(self) -> None:
        if self.error is not None:
            return
        try:
            for index in range(len(self.files)):  # only an empty model leaves a shard unwritten here
                if index not in self.done:
                    self._write_shard(index)
            if len(self.files) > 1:
                metadata: dict[str, object] = {"total_size": sum(self.plan.shard_sizes)}
                if self.tied_json is not None:
                    metadata["zinf_tied"] = self.tied_json
                entries = [*self.plan.params.values(), *(e for e, _ in self.plan.buffers)]
                weight_map = {e.name: self.files[e.shard] for e in entries}
                final = self.directory / INDEX
                tmp = final.with_name(final.name + ".tmp")
                text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
                tmp.write_text(text + "\n")
                os.replace(tmp, final)
                self.written.append(final)
        except Exception as exc:  # noqa: BLE001
            self.error = exc


def _agree(engine: "ZeroInfinityEngine", error: BaseException | None, what: str) -> None:
    """Raise on every rank when rank 0 failed (``error``), so no rank is left waiting in a collective."""
    failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=engine.comm.device)
    engine.comm.broadcast(failed, src=0)
    if error is not None:
        raise error
    if int(failed.item()):
        raise ZinfError(f"save_safetensors: rank 0 failed while {what}; see its error.")


def save_safetensors(engine: "ZeroInfinityEngine", directory: str | os.PathLike, *, max_shard_size: int | str = "10GB",
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
    plan = _plan(engine, limit, prefix, dtype)

    error: BaseException | None = None
    if rank0:
        try:
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"save_safetensors: {str(directory)!r} exists and is not a directory. "
                                 "Pass a directory path (it is created when missing).")
            directory.mkdir(parents=True, exist_ok=True)
            _clear_stale(directory)
        except Exception as exc:  # noqa: BLE001 - re-raised by _agree
            error = exc
    _agree(engine, error, f"preparing {directory}")

    writer = _Writer(directory, plan) if rank0 else None
    assembling: dict[str, dict[int, torch.Tensor]] = {}  # a tiled layer's tiles until the last one arrives
    with torch.no_grad():
        for g in engine.groups:
            full = g.gather_master_full(engine.master_of(g))
            if writer is None:
                continue
            for index, value in slot_views(full, [(s.offset, s.shape) for s in g.slots]):
                p = g.params[index]
                entry = plan.params.get(id(p)) if p is not None else None
                if entry is None:
                    continue
                value = value.to(device="cpu", dtype=entry.dtype, copy=True)
                if id(p) in plan.tile_index:
                    parts = assembling.setdefault(entry.name, {})
                    parts[plan.tile_index[id(p)]] = value
                    ins, outs = plan.grids[entry.name]
                    if len(parts) < len(ins) * len(outs):
                        continue
                    del assembling[entry.name]
                    value = torch.cat([torch.cat([parts[o * len(ins) + i] for i in range(len(ins))], 1)
                                       for o in range(len(outs))], 0)
                writer.add(entry, value)
            del full
        if writer is not None:
            for entry, b in plan.buffers:
                writer.add(entry, b.detach().to(device="cpu", dtype=entry.dtype, copy=True).contiguous())
            writer.finish()
    _agree(engine, writer.error if writer is not None else None, f"writing {directory}")

    if writer is None:
        return []
    total = sum(plan.shard_sizes)
    log.info("zinf: exported %d safetensors file(s), %d bytes, to %s", len(writer.files), total, directory)
    return writer.written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
