"""The engine's model and training state outside training: full (unsharded) state dicts, and this rank's part
of a sharded checkpoint, written and read one group at a time.

[Note: resharding]
A group's flat layout (its parameters' names, shapes and offsets) does not depend on the world size or the
placement; only the shard size does (``ceil(numel / world)``, the last shard padded). A checkpoint part stores
this rank's shard of every group's fp32 master and of each optimizer state tensor as flat vectors (see [Note:
portable optimizer state] in zinf/optim/protocol.py), so rank ``r`` of a new world takes elements
``[r * S, (r + 1) * S)`` of each group from the old parts that cover them: at most a few byte ranges, read with
their checksums (see [Note: part file] in zinf/checkpoint/part_file.py), one group at a time, straight into
the group's tier. Hyper-parameters, per-parameter step counts, the loss scaler and the step are the same on
every rank and come from rank 0's part; buffers from rank 0's part (every rank holds rank 0's buffers, as DDP
does), or from the rank's own part when buffers stay per rank and the world size is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from zinf.checkpoint.names import param_names, persistent_buffers
from zinf.checkpoint.part_file import PartReader, PartWriter, TensorSpec, payload
from zinf.checkpoint.source import ModelSource
from zinf.errors import CheckpointError, UnsupportedModelError
from zinf.tiling import merge_tiles, split_tiles, tile_spec
from zinf.param.gathered import gather_full_master

__all__ = ["slot_views", "user_names", "full_state_dict", "load_full_state_dict", "shard_layout", "write_part",
           "load_parts", "same_model", "check_buffers", "check_fits", "Loaded"]


def slot_views(flat: torch.Tensor, spans: list[tuple[int, Any]]) -> Iterator[tuple[int, torch.Tensor]]:
    """Cut a group's gathered flat vector into its parameters: ``(index, view)`` for each ``(offset, shape)``."""
    for index, (offset, shape) in enumerate(spans):
        shape = torch.Size(shape)
        yield index, flat[offset : offset + shape.numel()].view(shape)


def user_names(engine: ModelSource) -> dict[int, list[str]]:
    """Every name of each parameter, as the user's module names it (a front end's root prefix removed)."""
    prefix = engine.name_prefix
    return {pid: [n[len(prefix):] if prefix and n.startswith(prefix) else n for n in ns]
            for pid, ns in param_names(engine.module).items()}


def _user_buffers(engine: ModelSource) -> dict[str, torch.Tensor]:
    prefix = engine.name_prefix
    return {(n[len(prefix):] if prefix and n.startswith(prefix) else n): b
            for n, b in persistent_buffers(engine.module).items()}


def _user_tiles(engine: ModelSource) -> dict[str, dict[str, list[int]]]:
    prefix = engine.name_prefix
    return {(n[len(prefix):] if prefix and n.startswith(prefix) else n): g for n, g in tile_spec(engine.module).items()}


# -- full state dicts ----------------------------------------------------------------------------------------

def full_state_dict(engine: ModelSource, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """An ordinary (unsharded, fp32) state dict of the user's module, built one group at a time (collective)."""
    names = user_names(engine)
    keep = not rank0_only or engine.comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    for g in engine.groups:
        full = gather_full_master(engine.comm, g, g.master_shard.read())
        if not keep:
            continue
        for index, value in slot_views(full, [(s.offset, s.shape) for s in g.slots]):
            p = g.params[index]
            if p is not None:
                value = value.clone().cpu()
                for n in names[id(p)]:
                    out[n] = value
    if keep:
        buffers = {n: b.detach().clone() for n, b in _user_buffers(engine).items()}
        if not rank0_only and engine.config.broadcast_buffers:  # rank 0's on every rank, as rank 0 saves them
            engine.comm.broadcast_coalesced(list(buffers.values()), src=0)
        out.update({n: b.cpu() for n, b in buffers.items()})
    merge_tiles(out, _user_tiles(engine))  # tiled layers under their nn.Linear names
    return out


def load_full_state_dict(engine: ModelSource, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Every rank takes its shard of each parameter of ``state`` (an ordinary state dict, the same on every rank);
    with ``strict`` a missing or unexpected key is an error before anything changes. Names may carry the front
    end's root prefix or not."""
    prefix = engine.name_prefix
    if prefix and state and all(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items()}
    state = dict(state)
    errors = split_tiles(state, _user_tiles(engine))
    names = user_names(engine)
    buffers = _user_buffers(engine)
    found: dict[int, str] = {}
    missing = []
    for g in engine.groups:
        for p, slot in zip(g.params, g.slots):
            if p is None:
                continue
            key = next((n for n in names[id(p)] if n in state), None)
            if key is None:
                missing.append(names[id(p)][0])
            elif tuple(state[key].shape) != tuple(slot.shape):
                errors.append(f"size mismatch for {key}: the state dict has {tuple(state[key].shape)}, "
                              f"the model {tuple(slot.shape)}")
            else:
                found[id(p)] = key
    missing += [n for n in buffers if n not in state]
    errors += [f"size mismatch for buffer {n}: the state dict has {tuple(state[n].shape)}, the model {tuple(b.shape)}"
               for n, b in buffers.items() if n in state and tuple(state[n].shape) != tuple(b.shape)]
    known = {n for ns in names.values() for n in ns} | set(buffers)
    unexpected = [k for k in state if k not in known]
    if errors or (strict and (missing or unexpected)):
        raise UnsupportedModelError("zinf: load_full_state_dict: " + "; ".join(
            errors + ([f"missing keys {missing[:8]}"] if missing else [])
            + ([f"unexpected keys {unexpected[:8]}"] if unexpected else [])))
    with torch.no_grad():
        for g in engine.groups:
            kept = None if all(p is None or id(p) in found for p in g.params) else gather_full_master(engine.comm, g, g.master_shard.read())
            full = torch.zeros(g.padded_numel, dtype=torch.float32, device=engine.device)
            for p, slot in zip(g.params, g.slots):
                where = slice(slot.offset, slot.offset + slot.numel)
                if p is not None and id(p) in found:
                    full[where] = state[found[id(p)]].reshape(-1).to(full)
                elif p is not None and kept is not None:  # not loaded (strict=False): keep this parameter's values
                    full[where] = kept[where]
            lo = engine.comm.rank * g.shard_numel
            g.write_master(full[lo : lo + g.shard_numel].clone())
        for n, b in buffers.items():
            if n in state:
                b.copy_(state[n])


# -- this rank's part of a sharded checkpoint ----------------------------------------------------------------

def shard_layout(engine: ModelSource) -> list[dict[str, Any]]:
    """The groups' layout as a checkpoint records it: sizes, parameter names (the user's module's, so a checkpoint
    moves between front ends), shapes, offsets."""
    names = user_names(engine)
    return [{"numel": g.numel, "shard_numel": g.shard_numel,
             "params": [{"names": names.get(id(p), []), "shape": list(s.shape), "offset": s.offset}
                        for p, s in zip(g.params, g.slots)]}
            for g in engine.groups]


def same_model(saved: list[dict[str, Any]], mine: list[dict[str, Any]]) -> str | None:
    """Why a checkpoint's layout does not fit this model (``None`` when it does); shard sizes may differ."""
    def flat(layout: list[dict[str, Any]]) -> list[Any]:
        return [(g["numel"], g["params"]) for g in layout]

    a, b = flat(saved), flat(mine)
    if a == b:
        return None
    first = next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
    theirs = saved[first]["params"][0]["names"][:1] if first < len(saved) else "missing"
    ours = mine[first]["params"][0]["names"][:1] if first < len(mine) else "missing"
    return (f"it was written for a different model: group {first} differs (the checkpoint's starts with {theirs}, "
            f"{len(saved[first]['params']) if first < len(saved) else 0} parameters; this model's with {ours})")


def _master(gi: int) -> str:
    return f"master.{gi:05d}"


def _state(gi: int, key: str) -> str:
    return f"optim.{gi:05d}.{key}"


def _buffer(name: str) -> str:
    return f"buffer.{name}"


def write_part(engine: ModelSource, file: Any, record: dict[str, Any], client_state: Any,
               format_name: str) -> None:
    """Write this rank's part to ``file``: the fp32 master shard and optimizer state of every group, read from
    its tier one group at a time, buffers, and the record of everything else."""
    optimizer = engine.optimizer
    keys = [optimizer.state_keys(g) if optimizer is not None else [] for g in engine.groups]
    buffers = _user_buffers(engine)
    specs = []
    for gi, g in enumerate(engine.groups):
        specs.append(TensorSpec(_master(gi), torch.float32, (g.shard_numel,)))
        specs += [TensorSpec(_state(gi, k), optimizer.state_dtype(g, k), (g.shard_numel,)) for k in keys[gi]]
    specs += [TensorSpec(_buffer(n), b.dtype, b.shape) for n, b in buffers.items()]
    meta = {
        "world": engine.comm.world, "rank": engine.comm.rank, "layout": shard_layout(engine),
        "precision": engine.config.precision, "global_step": engine.global_step, "commit": record,
        "optimizer": optimizer.state_meta() if optimizer is not None else None, "optimizer_keys": keys,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "buffers": list(buffers), "tiling": _user_tiles(engine),
    }
    writer = PartWriter(file, specs, payload(meta, client_state), format_name)
    try:
        for gi, g in enumerate(engine.groups):
            writer.write(_master(gi), g.master_shard.read().detach().to("cpu", torch.float32))
            if keys[gi]:
                for k, v in optimizer.group_state(g).items():  # as the optimizer keeps them (bf16 moments in bf16)
                    writer.write(_state(gi, k), v.detach().to("cpu", optimizer.state_dtype(g, k)).reshape(-1))
        for n, b in buffers.items():
            writer.write(_buffer(n), b.detach().cpu())
        writer.finish()
    except BaseException:
        writer.abort()
        raise


class _Ranges:
    """Element ranges of a group's flat vector read from the old parts that hold them (see [Note: resharding])."""

    def __init__(self, part: Callable[[int], PartReader], old_world: int, old_layout: list[dict[str, Any]]) -> None:
        self.part, self.old_world, self.old_layout = part, old_world, old_layout

    def read(self, name: str, gi: int, lo: int, hi: int) -> torch.Tensor:
        numel, size = self.old_layout[gi]["numel"], self.old_layout[gi]["shard_numel"]
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for k in range(lo // size, min(self.old_world, -(-min(hi, numel) // size))):
            a, b = max(lo, k * size), min(hi, (k + 1) * size, numel)
            if a < b:
                out[a - lo : b - lo] = self.part(k).read(name, a - k * size, b - k * size)
        return out


@dataclass(frozen=True)
class Loaded:
    global_step: int
    client_state: Any


def load_parts(engine: ModelSource, first: dict[str, Any], part: Callable[[int], PartReader], old_world: int,
               buffers_from: int, client_state: Any) -> "Loaded":
    """Restore this rank's state from the parts of a checkpoint of ``old_world`` ranks: ``first`` is rank 0's
    record, ``part(k)`` rank ``k``'s reader (opened and checked by the caller), buffers from rank
    ``buffers_from``'s part; returns the step and ``client_state`` (read by the caller before anything changed) for
    the engine to take. The caller has checked the layout (``check_fits``)."""
    ranges = _Ranges(part, old_world, first["layout"])
    optimizer = engine.optimizer if first["optimizer"] is not None else None
    if optimizer is not None:
        optimizer.load_state_meta(first["optimizer"])
    with torch.no_grad():
        for gi, g in enumerate(engine.groups):
            lo = engine.comm.rank * g.shard_numel
            g.write_master(ranges.read(_master(gi), gi, lo, lo + g.shard_numel).to(engine.device))
            if optimizer is not None:
                keys = first["optimizer_keys"][gi]
                optimizer.load_group_state(g, {k: ranges.read(_state(gi, k), gi, lo, lo + g.shard_numel) for k in keys})
        buffers, source = _user_buffers(engine), part(buffers_from)
        for n in source.meta["buffers"]:
            if n in buffers:
                buffers[n].copy_(source.read(_buffer(n)))
    if optimizer is not None:
        optimizer.finish_load()
    if engine.loss_scaler is not None and first["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(first["loss_scaler"])
    return Loaded(global_step=first["global_step"], client_state=client_state)


def check_buffers(engine: ModelSource, source: Any) -> None:
    """Raise when the buffers of ``source`` (the part buffers are loaded from) are not the engine's: the same names
    and shapes, before anything is loaded."""
    buffers = _user_buffers(engine)
    saved = list(source.meta["buffers"])
    why = [f"missing buffers {sorted(set(buffers) - set(saved))[:8]}"] if set(buffers) - set(saved) else []
    why += [f"unexpected buffers {sorted(set(saved) - set(buffers))[:8]}"] if set(saved) - set(buffers) else []
    why += [f"buffer {n} is {list(source.spec(_buffer(n)).shape)} in the checkpoint, {list(buffers[n].shape)} in the "
            "model" for n in saved if n in buffers and tuple(source.spec(_buffer(n)).shape) != tuple(buffers[n].shape)]
    if why:
        raise CheckpointError(f"zinf checkpoint: another model's buffers ({'; '.join(why)}); load it into the model "
                              "that saved it, or what matches with engine.load_full_state_dict("
                              "zinf.checkpoint.consolidate(path), strict=False).")


def check_fits(engine: ModelSource, meta: dict[str, Any]) -> None:
    """Raise when a part's record cannot be loaded into ``engine`` (another model; optimizer state where the
    engine has none is ignored, none where it has one is an error)."""
    why = same_model(meta["layout"], shard_layout(engine))
    if why is not None:
        raise CheckpointError(f"zinf checkpoint: {why}.")
    if engine.optimizer is not None and meta["optimizer"] is None:
        raise CheckpointError("zinf checkpoint: it holds no optimizer state (saved by an engine without an optimizer); "
                              "load the weights with engine.load_full_state_dict(zinf.checkpoint.consolidate(path)).")
    if engine.optimizer is not None:
        try:
            engine.optimizer.check_state(meta["optimizer"], meta["optimizer_keys"])
        except ValueError as exc:  # before anything is loaded: the engine is left as it was
            raise CheckpointError(f"{exc} Nothing was loaded.") from None
