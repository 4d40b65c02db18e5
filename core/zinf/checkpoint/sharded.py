"""One file per rank: its fp32 master shards, its optimizer state, the loss scaler and the step.

Layout of a checkpoint directory::

    rank00000-of-00002.pt   rank00001-of-00002.pt   (written to a temporary name, then renamed)

Each file records the format, world size, rank and the group layout (names, sizes, parameter names and
shapes), so loading into a different model or world size fails with a message naming what differs
instead of training on mismatched values. ``consolidate`` rebuilds an ordinary, unsharded
``state_dict`` from the files alone (no process group needed), with tiled layers under their untiled
names (see [Note: untiled names] in zinf/tiling.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zinf.errors import ZinfError
from zinf.tiling import merge_tiles, tile_spec

if TYPE_CHECKING:
    from zinf.engine import ZeroInfinityEngine

__all__ = ["save_sharded", "load_sharded", "consolidate", "read_client_state", "CheckpointError"]

FORMAT = "zinf-sharded-v1"


class CheckpointError(ZinfError):
    """A checkpoint is missing, truncated, foreign, or does not fit the model/world it is loaded into."""


def _file(path: Path, rank: int, world: int) -> Path:
    return path / f"rank{rank:05d}-of-{world:05d}.pt"


def _layout(engine: "ZeroInfinityEngine") -> list[dict[str, Any]]:
    names: dict[int, list[str]] = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [
        {"numel": g.numel, "shard_numel": g.shard_numel,
         "params": [{"names": names.get(id(p), []), "shape": list(s.shape), "offset": s.offset}
                    for p, s in zip(g.params, g.slots)]}
        for g in engine.groups
    ]


def save_sharded(engine: "ZeroInfinityEngine", path: str | os.PathLike, client_state: dict | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    comm = engine.comm
    payload = {
        "format": FORMAT, "world": comm.world, "rank": comm.rank, "layout": _layout(engine),
        "precision": engine.config.precision, "master": [engine.master_of(g).detach().cpu() for g in engine.groups],
        "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "global_step": engine.global_step, "client_state": client_state or {},
        "buffers": {n: b.detach().cpu() for n, b in engine.module.named_buffers()},
        "tiling": tile_spec(engine.module),  # so consolidate can give tiled layers their nn.Linear names
    }
    final = _file(path, comm.rank, comm.world)
    tmp = final.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, final)  # a crash mid-write never leaves a file that looks complete
    return final


def _read(file: Path) -> dict[str, Any]:
    if not file.exists():
        raise CheckpointError(f"zinf checkpoint: {file} does not exist. Was it written with the same world size?")
    try:
        payload = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise CheckpointError(f"zinf checkpoint: {file} is truncated or not a checkpoint ({exc}).") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"zinf checkpoint: {file} is not a {FORMAT} file (foreign or from another version).")
    return payload


def load_sharded(engine: "ZeroInfinityEngine", path: str | os.PathLike) -> dict:
    """Restore weights, optimizer state, loss scale and step into ``engine``; returns the client state."""
    path, comm = Path(path), engine.comm
    payload = _read(_file(path, comm.rank, comm.world))
    if payload["world"] != comm.world:
        raise CheckpointError(f"zinf checkpoint: written by {payload['world']} ranks, loading on {comm.world}. "
                              "Load on the same world size, or consolidate it (zinf consolidate) and load the full state dict.")
    mine = _layout(engine)
    if payload["layout"] != mine:
        first = next(i for i, (a, b) in enumerate(zip(payload["layout"] + [None], mine + [None])) if a != b)
        raise CheckpointError(f"zinf checkpoint: {path} was written for a different model (group {first} differs: "
                              f"{payload['layout'][first] if first < len(payload['layout']) else 'missing'}).")
    with torch.no_grad():
        for g, master in zip(engine.groups, payload["master"]):
            engine.set_master(g, master.to(engine.device))
        buffers = dict(engine.module.named_buffers())
        for n, b in payload["buffers"].items():
            buffers[n].copy_(b)
    if engine.optimizer is not None and payload["optimizer"] is not None:
        engine.optimizer.load_state_dict(payload["optimizer"])
    if engine.loss_scaler is not None and payload["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(payload["loss_scaler"])
    engine.global_step = payload["global_step"]
    return payload["client_state"]


def read_client_state(path: str | os.PathLike) -> dict:
    """The ``client_state`` saved with a checkpoint (the same on every rank; read from rank 0's file)."""
    files = sorted(Path(path).glob("rank00000-of-*.pt"))
    if not files:
        raise CheckpointError(f"zinf checkpoint: no rank00000-of-*.pt file in {path}.")
    return _read(files[0])["client_state"]


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An ordinary fp32 ``state_dict`` (parameters and buffers) from a sharded checkpoint directory."""
    path = Path(path)
    files = sorted(path.glob("rank*-of-*.pt"))
    if not files:
        raise CheckpointError(f"zinf checkpoint: no rank*-of-*.pt files in {path}.")
    first = _read(files[0])
    world = first["world"]
    payloads = [first] + [_read(_file(path, r, world)) for r in range(1, world)]
    out: dict[str, torch.Tensor] = {}
    for gi, group in enumerate(first["layout"]):
        flat = torch.cat([p["master"][gi] for p in payloads])
        for param in group["params"]:
            numel = int(torch.Size(param["shape"]).numel())
            value = flat[param["offset"] : param["offset"] + numel].view(param["shape"]).clone()
            for name in param["names"]:
                out[name] = value
    out.update(first["buffers"])
    merge_tiles(out, first.get("tiling", {}))
    return out
