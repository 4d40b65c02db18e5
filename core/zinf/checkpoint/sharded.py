"""Sharded checkpoints: one part per rank, made current together by ``commit.json``, loadable on any world size
and placement.

The parts of one save become the current checkpoint together through ``commit.json`` (see [Note: commit
protocol] in zinf/checkpoint/commit.py): a save killed or failing on any rank leaves the previous checkpoint
current, and a reader never mixes the parts of two saves. Each part is a safetensors file with a checksum per
chunk (see [Note: part file] in zinf/checkpoint/part_file.py) and a record of the format, world, rank, group
layout and commit it belongs to, so a flipped byte, a truncated or foreign file, or a different model is an
error naming the file, never weights loaded. A load on another world size or placement reads only the byte
ranges of its new shards (see [Note: resharding] in zinf/checkpoint/model_state.py). ``consolidate`` and
``iter_state`` rebuild the full state from the files alone (no process group), one group at a time, under the
names of the user's module (tiled layers under their untiled names, see [Note: untiled names] in
zinf/tiling.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch

from zinf.checkpoint.commit import Save
from zinf.checkpoint.commit_record import Commit, agreed_commit, check_part, raise_if_any, require_commit
from zinf.checkpoint.leftovers import tidy
from zinf.checkpoint.model_state import Loaded, check_buffers, check_fits, load_parts, slot_views, write_part
from zinf.checkpoint.part_file import PartReader
from zinf.checkpoint.safetensors_header import TensorSpec
from zinf.checkpoint.source import ModelSource
from zinf.errors import CheckpointError, PartlyLoadedError
from zinf.heap import trim_heap
from zinf.tiling import merge_tiles

__all__ = ["save_sharded", "load_sharded", "consolidate", "iter_state", "state_specs", "open_checkpoint",
           "read_client_state", "Checkpoint", "CheckpointError", "FORMAT"]

FORMAT = "zinf-sharded-v3"  # record as JSON, client state loaded weights_only (zinf-sharded-v2: pickled)


def save_sharded(engine: ModelSource, path: str | os.PathLike, client_state: Any = None) -> Path:
    """Every rank writes its part of a new checkpoint of the engine's step under ``path`` (a directory), reading
    its state one group at a time; once all parts are on disk, rank 0 commits it and the previous checkpoint's
    files are removed. Collective; returns this rank's file. When any rank fails (a full disk, a failed background
    step), every rank raises CheckpointError, nothing of the save is kept, and the previous checkpoint stays
    current."""
    save = Save(Path(path), engine.comm, engine.global_step)
    save.write(lambda file, record: write_part(engine, file, record, client_state or {}, FORMAT))
    save.agree()
    save.commit()
    return save.part


class Checkpoint:
    """The current save of a checkpoint directory; each rank's part is opened (and checked to belong to that
    save) on first use. ``allow_pickle``: the user trusts the files (see [Note: client state loading] in
    zinf/checkpoint/client_state.py)."""

    def __init__(self, path: Path, commit: Commit, allow_pickle: bool = False) -> None:
        self.path, self.commit, self.allow_pickle = path, commit, allow_pickle
        self._parts: dict[int, PartReader] = {}

    def part(self, rank: int) -> PartReader:
        if rank not in self._parts:
            file = self.path / self.commit.file(rank)
            if not file.exists():
                raise CheckpointError(
                    f"zinf checkpoint: {file} does not exist, but {self.path / 'commit.json'} names it as rank {rank}'s "
                    f"part of {self.commit.describe()}: the checkpoint is incomplete{self.commit.where(rank)}. Restore "
                    "the file, or load another checkpoint.")
            reader = PartReader(file, FORMAT, self.allow_pickle)
            try:
                check_part(reader.meta.get("commit"), self.commit, rank, file)
            except BaseException:
                reader.close()
                raise
            self._parts[rank] = reader
        return self._parts[rank]

    def close(self) -> None:
        for reader in self._parts.values():
            reader.close()
        self._parts.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike, allow_pickle: bool = False) -> Checkpoint:
    """The current save in ``path`` (no process group needed); ``allow_pickle``: the user trusts its files."""
    path = Path(path)
    return Checkpoint(path, require_commit(path), allow_pickle)


def load_sharded(engine: ModelSource, path: str | os.PathLike, allow_pickle: bool = False) -> Loaded:
    """Restore the checkpoint that ``path/commit.json`` names into ``engine``, whatever world size and placement
    wrote it; returns the step and client state for the engine to take. Collective. Every part this rank needs is
    opened and checked against the model, and the client state read, before anything changes; when any rank finds a
    problem, every rank raises CheckpointError. A checksum failure while the state streams in (a byte flipped inside
    a tensor) raises PartlyLoadedError on every rank. ``allow_pickle``: the user trusts the files (client state of
    any type, parts of the earlier pickled format)."""
    path = Path(path)
    comm = engine.comm
    commit = agreed_commit(path, comm)
    tidy(path, commit, comm.rank, comm.world, loading=True)  # files of a killed or failed save
    checkpoint = Checkpoint(path, commit, allow_pickle)
    try:
        problem, error, first, client_state = None, None, None, None
        try:
            if commit.world != comm.world and not commit.shared:
                raise CheckpointError(
                    f"zinf checkpoint: {path} holds {commit.describe()} on storage each node holds alone (see "
                    f"{path / 'commit.json'}); loading on {comm.world} rank(s) would need other nodes' files. Copy "
                    "every part into one shared directory to load it on another world size.")
            if comm.rank == 0:
                first = checkpoint.part(0).meta
        except Exception as exc:  # noqa: BLE001 - every rank raises together, none is left waiting in a collective
            error, problem = exc, _problem(exc)
        problems = comm.all_gather_object((problem, first))
        first = problems[0][1]
        if first is None:  # rank 0 could not read its record (the same on every rank: rank 0's)
            raise_if_any(comm, problem, error)
        own = commit.world == comm.world and (not commit.shared or not engine.config.broadcast_buffers)
        try:
            check_fits(engine, first)
            for rank in _sources(engine, first, commit):
                checkpoint.part(rank)
            check_buffers(engine, checkpoint.part(comm.rank if own else 0))
            client_state = checkpoint.part(comm.rank if commit.world == comm.world else 0).client_state()
        except Exception as exc:  # noqa: BLE001
            error, problem = exc, _problem(exc)
        raise_if_any(comm, problem, error)
        try:
            loaded = load_parts(engine, first, checkpoint.part, commit.world, buffers_from=comm.rank if own else 0,
                                client_state=client_state)
        except Exception as exc:  # noqa: BLE001
            error, problem = exc, _problem(exc)
        try:
            raise_if_any(comm, problem, error)
        except CheckpointError as exc:
            raise PartlyLoadedError(f"zinf checkpoint: loading {path} failed part way ({exc}), so the model and optimizer "
                                    "state are partly replaced. Load a checkpoint that loads completely before "
                                    "training.") from exc
        return loaded
    finally:
        checkpoint.close()


def _problem(exc: Exception) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _sources(engine: ModelSource, first: dict[str, Any], commit: Commit) -> list[int]:
    """The old ranks whose parts this rank reads (its own alone on node-local storage: same world, same shards)."""
    if not commit.shared:
        return [engine.comm.rank]
    needed: set[int] = {0}
    if commit.world == engine.comm.world:
        needed.add(engine.comm.rank)
    for gi, g in enumerate(engine.groups):
        size = first["layout"][gi]["shard_numel"]
        lo = engine.comm.rank * g.shard_numel
        hi = min(lo + g.shard_numel, g.numel)
        if lo < hi:
            needed.update(range(lo // size, min(commit.world, -(-hi // size))))
    return sorted(needed)


def read_client_state(path: str | os.PathLike, allow_pickle: bool = False) -> Any:
    """The ``client_state`` saved with the current checkpoint in ``path`` (the same on every rank; rank 0's), read
    as [Note: client state loading] in zinf/checkpoint/client_state.py says."""
    with open_checkpoint(path, allow_pickle) as checkpoint:
        return checkpoint.part(0).client_state()


def iter_state(path: str | os.PathLike, *, prefix: str | None = None,
               allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The full fp32 state of the current checkpoint in ``path``, one tensor at a time under the user's module's
    names: parameters group by group (each group gathered from the parts, one group in memory at a time; a tied
    weight under each of its names), then persistent buffers. A tiled layer's weight comes whole, when its last
    tile has been read. ``prefix``: a prefix to remove from every name. The client state is not read;
    ``allow_pickle`` opens parts of the earlier, pickled format."""
    with open_checkpoint(path, allow_pickle) as checkpoint:
        first = checkpoint.part(0).meta
        world = checkpoint.commit.world
        tiles = first.get("tiling", {})
        pending: dict[str, torch.Tensor] = {}

        def named(name: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
            if not _is_tile(name, tiles):
                yield _strip(name, prefix), value
                return
            pending[name] = value  # a tile: kept until merge_tiles can build its layer's weight
            merge_tiles(pending, tiles)
            for key in [k for k in pending if not _is_tile(k, tiles)]:
                yield _strip(key, prefix), pending.pop(key)

        for gi, group in enumerate(first["layout"]):
            shards = [checkpoint.part(k).read(f"master.{gi:05d}") for k in range(world)]
            flat = shards[0] if world == 1 else torch.cat(shards)  # one copy of the group in memory, not two
            del shards
            spans = [(p["offset"], p["shape"]) for p in group["params"]]
            for index, value in slot_views(flat, spans):
                value = value.clone()
                for name in group["params"][index]["names"]:
                    yield from named(name, value)
            del flat
            trim_heap()  # the group's memory back before the next is read: [Note: heap growth] in heap.py
        buffers = checkpoint.part(0)
        for name in first["buffers"]:
            yield from named(name, buffers.read(f"buffer.{name}").clone())
        if pending:
            raise CheckpointError(f"zinf checkpoint: {path}: tiles {sorted(pending)[:4]} have no complete layer.")


def state_specs(path: str | os.PathLike, *, prefix: str | None = None,
                allow_pickle: bool = False) -> tuple[list[TensorSpec], dict[str, str]]:
    """What :func:`iter_state` yields, from rank 0's record alone (no tensor is read): every tensor's name, dtype
    (fp32 for parameters, a buffer's own) and shape, a tied weight once under its first name, in the order
    ``iter_state`` yields them (a tiled layer's weight at its first tile's place: ``iter_state`` yields it after
    its last); and alias -> first name for the other names of each tied weight."""
    with open_checkpoint(path, allow_pickle) as checkpoint:
        part = checkpoint.part(0)
        first = part.meta
        tiles = first.get("tiling", {})
        specs: list[TensorSpec] = []
        tied: dict[str, str] = {}
        merged: set[str] = set()
        for group in first["layout"]:
            for param in group["params"]:
                names = [_strip(n, prefix) for n in param["names"]]
                if not names:
                    continue
                if _is_tile(param["names"][0], tiles):
                    layer = next(n for n in tiles if param["names"][0].startswith(f"{n}.tiles." if n else "tiles."))
                    name = _strip(f"{layer}.weight" if layer else "weight", prefix)
                    if name not in merged:
                        merged.add(name)
                        grid = tiles[layer]
                        specs.append(TensorSpec(name, torch.float32, (sum(grid["out"]), sum(grid["in"]))))
                    continue
                specs.append(TensorSpec(names[0], torch.float32, param["shape"]))
                tied.update((alias, names[0]) for alias in names[1:])
        for name in first["buffers"]:
            stored = part.spec(f"buffer.{name}")
            specs.append(TensorSpec(_strip(name, prefix), stored.dtype, stored.shape))
        return specs, tied


def _is_tile(key: str, tiles: dict[str, Any]) -> bool:
    return key.endswith(".weight") and any(key.startswith(f"{layer}.tiles." if layer else "tiles.") for layer in tiles)


def _strip(name: str, prefix: str | None) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def consolidate(path: str | os.PathLike, *, prefix: str | None = None, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """An ordinary fp32 ``state_dict`` (parameters and buffers) from the current checkpoint in ``path``, under the
    names of the user's module: ``model.load_state_dict(state)`` takes it. Holds the whole model; to write a large
    one to disk with bounded memory use ``zinf consolidate`` (or :func:`iter_state`)."""
    return dict(iter_state(path, prefix=prefix, allow_pickle=allow_pickle))
