"""One file per rank: its fp32 master shards, its optimizer state, the loss scaler and the step.

The files of one save become the current checkpoint together, through ``commit.json`` (see
[Note: commit protocol] in zinf/checkpoint/commit.py): a save killed or failing on any rank leaves the
previous checkpoint current, and a reader never mixes the files of two saves.

Every tensor in a file is covered by a CRC32C recorded beside it and checked by every reader, so a
flipped or zeroed byte is an error naming the file and the tensor, never weights loaded. Each file records
the format, world size, rank, the group layout (names, sizes, parameter names and
shapes) and the commit it belongs to, so loading into a different model or world size, or from a directory
that mixes saves, fails with a message naming what differs instead of training on mismatched values.
``consolidate`` rebuilds an ordinary, unsharded ``state_dict`` from the files alone (no process group
needed), with tiled layers under their untiled names (see [Note: untiled names] in zinf/tiling.py) and
without the prefix of a front end's wrapper (see [Note: name prefix]).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zinf import native
from zinf.checkpoint.commit import Commit, Save, agreed_commit, check_part, raise_if_any, require_commit, tidy
from zinf.errors import CheckpointError
from zinf.fetch.comm import Comm
from zinf.tiling import merge_tiles

__all__ = ["save_sharded", "load_sharded", "consolidate", "read_client_state", "CheckpointError"]

FORMAT = "zinf-sharded-v1"


# what an engine hands over (``ZeroInfinityEngine.shard_state``): this rank's part, without format fields
STATE_KEYS = ("layout", "precision", "master", "optimizer", "loss_scaler", "global_step", "buffers", "tiling")


def save_sharded(comm: Comm, path: str | os.PathLike, step: int, shard_state: Callable[[], dict[str, Any]],
                 client_state: dict | None = None) -> Path:
    """Every rank writes its part of a new checkpoint of ``step`` under ``path`` (a directory): ``shard_state()``
    (``ZeroInfinityEngine.shard_state``) is called as the part is written, so an error reading the state (a failed
    background step, a bad offload record) fails the save like any other; once all parts are on disk, rank 0
    commits it and the previous checkpoint's files are removed. Collective; returns this rank's file. When any rank
    fails (a full disk, say), every rank raises CheckpointError, nothing of the save is kept, and the previous
    checkpoint stays current."""

    def part() -> dict[str, Any]:
        state = shard_state()
        missing = [k for k in STATE_KEYS if k not in state]
        assert not missing, f"shard state lacks {missing}"
        return _with_checksums({"format": FORMAT, "world": comm.world, "rank": comm.rank, **state,
                                "client_state": client_state or {}})

    save = Save(Path(path), comm, step)
    save.write(part)
    save.agree()
    save.commit()
    return save.part


def _read(file: Path) -> dict[str, Any]:
    try:
        payload = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise CheckpointError(f"zinf checkpoint: {file} is truncated or not a checkpoint ({exc}).") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"zinf checkpoint: {file} is not a {FORMAT} file (foreign or from another version).")
    _verify_checksums(payload, file)
    return payload


def _tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a payload, with its path (``master[3]``, ``optimizer.state.5.exp_avg``), in a fixed order."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")


def _crc(t: torch.Tensor) -> int:
    return native.crc32c(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)) if t.numel() else 0


# the engine's own values besides tensors (step, hyper-parameters, layout, commit): checksummed as their pickle,
# which is the same bytes for the same plain values in any process (the client state may hold sets or objects
# whose pickle is not, so only its tensors are covered; the commit record is checked against commit.json)
_META_KEYS = ("format", "world", "rank", "layout", "precision", "optimizer", "loss_scaler", "global_step", "tiling")


def _skeleton(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v) for v in value)
    return value


def _meta_crc(payload: dict[str, Any]) -> int:
    meta = {k: _skeleton(payload.get(k)) for k in _META_KEYS}
    return native.crc32c(pickle.dumps(meta, protocol=4))


def _with_checksums(payload: dict[str, Any]) -> dict[str, Any]:
    """Add the CRC32C of every tensor's bytes (``checksums``: path -> crc) and of the engine's other values
    (``meta_checksum``), verified by every reader."""
    payload["checksums"] = {path: _crc(t) for path, t in _tensors(payload)}
    payload["meta_checksum"] = _meta_crc(payload)
    return payload


def _verify_checksums(payload: dict[str, Any], file: Path) -> None:
    expected = payload.get("checksums")
    if expected is None:
        raise CheckpointError(f"zinf checkpoint: {file} carries no checksums (written by an earlier zinf); resume it "
                              "with that version and save again, or consolidate it there and load the state dict.")
    found = {path: t for path, t in _tensors({k: v for k, v in payload.items() if k not in ("checksums", "meta_checksum")})}
    if set(found) != set(expected):
        missing = sorted(set(expected) ^ set(found))[:4]
        raise CheckpointError(f"zinf checkpoint: {file} is damaged: its tensors do not match its list of checksums "
                              f"({missing}). Restore the file from a copy or load another checkpoint.")
    meta = payload.get("meta_checksum")
    if meta is not None and _meta_crc(payload) != meta:
        raise CheckpointError(f"zinf checkpoint: {file} is corrupted: its step, hyper-parameters or layout do not match "
                              "their checksum. Nothing was loaded; restore the file from a copy or load another checkpoint.")
    for path, t in found.items():
        actual = _crc(t)
        if actual != expected[path]:
            raise CheckpointError(
                f"zinf checkpoint: {file} is corrupted: tensor {path} ({t.numel() * t.element_size()} bytes, "
                f"{t.dtype}) has CRC32C {actual:#010x}, {expected[path]:#010x} was written. Nothing was loaded; restore "
                "the file from a copy or load another checkpoint.")


def _read_part(path: Path, commit: Commit, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file of the save ``commit`` names, checked to belong to that save."""
    file = path / commit.file(rank)
    if not file.exists():
        raise CheckpointError(f"zinf checkpoint: {file} does not exist, but {path / 'commit.json'} names it as rank "
                              f"{rank}'s part of {commit.describe()}: the checkpoint is incomplete. Restore the file, "
                              "or load another checkpoint.")
    payload = _read(file)
    check_part(payload.get("commit"), commit, rank, file)
    return payload


def load_sharded(comm: Comm, path: str | os.PathLike, layout: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's part of the checkpoint that ``path/commit.json`` names, checked against ``layout`` (the
    engine's ``shard_layout()``): the caller restores it (``ZeroInfinityEngine.load_shard_state``). Collective:
    when any rank's file is missing, from another save or does not fit, every rank raises CheckpointError and
    nothing is returned to change anything with."""
    path = Path(path)
    commit = agreed_commit(path, comm)
    tidy(path, commit, comm.rank, comm.world, loading=True)  # files of a killed or failed save
    payload, problem, error = None, None, None
    try:
        if commit.world != comm.world:
            raise CheckpointError(
                f"zinf checkpoint: {path} holds {commit.describe()}, loading on {comm.world} rank(s): a file for rank "
                f"{comm.rank} of {comm.world} does not exist. Load on the same world size, or consolidate it "
                "(zinf consolidate) and load the full state dict.")
        payload = _read_part(path, commit, comm.rank)
        mine = layout
        if payload["layout"] != mine:
            first = next(i for i, (a, b) in enumerate(zip(payload["layout"] + [None], mine + [None])) if a != b)
            raise CheckpointError(f"zinf checkpoint: {path} was written for a different model (group {first} differs: "
                                  f"{payload['layout'][first] if first < len(payload['layout']) else 'missing'}).")
    except Exception as exc:  # noqa: BLE001 - every rank raises together, none is left waiting in a collective
        error, problem = exc, str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    raise_if_any(comm, problem, error)
    assert payload is not None
    return payload


def read_client_state(path: str | os.PathLike) -> dict:
    """The ``client_state`` saved with the current checkpoint in ``path`` (the same on every rank; rank 0's)."""
    path = Path(path)
    return _read_part(path, require_commit(path), 0)["client_state"]


# [Note: name prefix]
# A front end that wraps the user's model in a root module of its own (the Lightning and Fabric strategies hold
# it as the root's child ``module``) has every name the engine records prefixed by that root. It records the
# prefix in each part as ``name_prefix`` (an optional payload field, not part of the layout or its checksum, so
# resuming is unchanged), and ``consolidate`` removes it: the state dict has the names of the model the user
# built and loads into it with ``load_state_dict``. Lightning Trainer checkpoints of an earlier zinf, which
# carry no ``name_prefix``, are recognised by the Trainer state in their client state.
_LIGHTNING_ROOT = "module."
_LIGHTNING_STATE = "pytorch-lightning_version"  # in every Trainer checkpoint's client state


def _name_prefix(payload: dict[str, Any], names: list[str]) -> str:
    recorded = payload.get("name_prefix")
    if isinstance(recorded, str):
        return recorded
    client = payload.get("client_state")
    if isinstance(client, dict) and _LIGHTNING_STATE in client and names and all(
            n.startswith(_LIGHTNING_ROOT) for n in names):
        return _LIGHTNING_ROOT
    return ""


def consolidate(path: str | os.PathLike, *, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """An ordinary fp32 ``state_dict`` (parameters and buffers) from the current checkpoint in ``path``, under
    the names of the model the user built (see [Note: name prefix]): ``model.load_state_dict(state)`` takes it.
    ``prefix``: remove this prefix from the names instead of the one the checkpoint records (``""``: keep the
    names as the engine recorded them)."""
    path = Path(path)
    commit = require_commit(path)
    payloads = [_read_part(path, commit, r) for r in range(commit.world)]
    first = payloads[0]
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
    if prefix is None:
        prefix = _name_prefix(first, list(out))
    if prefix:
        out = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in out.items()}
    return out
