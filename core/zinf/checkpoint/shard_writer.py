"""Model files in the Hugging Face layout, planned from names and shapes and written as the tensors arrive.

[Note: model files]
Both model exports write through this file: the live one (zinf/checkpoint/export.py: rank 0 of a running engine,
tensors gathered group by group) and the offline one (zinf/checkpoint/convert.py, ``zinf consolidate``: tensors
read group by group from a checkpoint's parts). Each knows every tensor's name, dtype and shape before reading
any, so the files are planned up front:

    model.safetensors                          everything fits in ``max_shard_size``
    model-00001-of-00003.safetensors  ...      or: several shards
    model.safetensors.index.json               {"metadata": {"total_size": bytes, ...}, "weight_map": {name: file}}

(``pytorch_model.bin``, ``pytorch_model-0000i-of-0000n.bin`` and ``pytorch_model.bin.index.json`` for torch
files.) Shards are filled greedily in the order the tensors come, as ``transformers`` does: a new shard starts
when the next tensor would overflow the limit, so a tensor larger than the limit sits alone. A tied weight (one
tensor under several names) is planned once, under its first name; safetensors refuses shared storage, so the
other names go in the metadata key ``zinf_tied`` (the index's, or the single file's) as a JSON string mapping
alias -> kept name (``transformers`` re-ties from the model config, as after ``save_pretrained``); a torch file
holds every name (``torch.save`` stores the shared storage once), so ``load_state_dict`` takes it as it is.

A safetensors shard is written as a stream: its header goes first (every size is known) and each tensor is
written at its offset when it arrives, so a shard never sits in memory; a torch shard is held until complete
(``torch.save`` needs the whole dict). Every file is written under a temporary name (``NAME.tmp``), flushed to
disk, then renamed (``os.replace``) once complete, the index last: a crash never leaves a file that looks complete.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from zinf.checkpoint.safetensors_header import TensorSpec, build_header, widest_first
from zinf.errors import ConfigError, ZinfError
from zinf.file_io import remove_quietly, write_at, write_bytes_at

__all__ = ["FileLayout", "SAFETENSORS", "TORCH", "ShardPlan", "plan_shards", "ShardWriter", "parse_size",
           "written_dtype"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, what: str = "save_safetensors: max_shard_size") -> int:
    """Bytes from an int or a string such as ``"500KB"``, ``"5MB"``, ``"10GB"`` (powers of 1000) or ``"1GiB"``;
    ``what`` names the setting in the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        size = -1
    if size <= 0:
        raise ConfigError(f"{what}={value!r} is not a size. Pass a positive number of bytes or a string like "
                          "'500KB', '5MB', '10GB' (powers of 1000) or '512MiB', '1GiB' (powers of 1024).")
    return size


def written_dtype(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: ``dtype`` for floating-point tensors when given, else its own."""
    return dtype if dtype is not None and source.is_floating_point else source


@dataclass(frozen=True)
class FileLayout:
    """The file names of one format (see [Note: model files])."""

    format: str  # "safetensors" or "torch"
    single: str
    shard: str  # with {i} and {n}
    index: str
    shard_pattern: str  # a regular expression matching every shard name

    def names(self, count: int) -> list[str]:
        return [self.single] if count == 1 else [self.shard.format(i=i + 1, n=count) for i in range(count)]

    def is_own(self, name: str) -> bool:
        """Whether a file called ``name`` is one of this layout's (or its temporary name)."""
        name = name.removesuffix(".tmp")
        return name in (self.single, self.index) or re.fullmatch(self.shard_pattern, name) is not None

    def clear(self, directory: Path) -> None:
        """Remove what an earlier export (or a crashed one's temporary files) left in ``directory``."""
        for path in directory.iterdir():
            if path.is_file() and self.is_own(path.name):
                path.unlink()


SAFETENSORS = FileLayout("safetensors", "model.safetensors", "model-{i:05d}-of-{n:05d}.safetensors",
                         "model.safetensors.index.json", r"model-\d{5}-of-\d{5}\.safetensors")
TORCH = FileLayout("torch", "pytorch_model.bin", "pytorch_model-{i:05d}-of-{n:05d}.bin", "pytorch_model.bin.index.json",
                   r"pytorch_model-\d{5}-of-\d{5}\.bin")


@dataclass
class ShardPlan:
    """Every tensor to write (as written: name, dtype, shape), in arrival order, and its shard."""

    specs: list[TensorSpec]
    tied: dict[str, str]  # alias -> kept name
    shards: list[list[TensorSpec]]
    shard_of: dict[str, int]  # name -> index in shards
    by_name: dict[str, TensorSpec]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def plan_shards(specs: Sequence[TensorSpec], tied: dict[str, str], limit_bytes: int, dtype: torch.dtype | None,
                duplicate_hint: str = "") -> ShardPlan:
    """Plan the shards of ``specs`` (names and source dtypes, in the order they will arrive; each tied weight once),
    cast to ``dtype`` where :func:`written_dtype` says so, greedily under ``limit_bytes``."""
    written = [TensorSpec(s.name, written_dtype(s.dtype, dtype), s.shape) for s in specs]
    shards: list[list[TensorSpec]] = []
    shard_of: dict[str, int] = {}
    size = 0
    for spec in written:
        if spec.name in shard_of:
            raise ValueError(f"two different tensors would both be written as {spec.name!r}.{duplicate_hint}")
        if not shards or size + spec.nbytes > limit_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        shard_of[spec.name] = len(shards) - 1
        size += spec.nbytes
    return ShardPlan(written, dict(tied), shards or [[]],  # a model with no tensors still gets its (empty) file
                     shard_of, {s.name: s for s in written})


class _StreamedShard:
    """One safetensors shard being written: header first, each tensor at its offset (see [Note: model files])."""

    def __init__(self, tmp: Path, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        ordered = widest_first(specs)
        head, offsets = build_header(ordered, metadata)
        self.tmp = tmp
        self.offsets = {name: len(head) + at for name, at in offsets.items()}
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies, as for any file
        try:
            write_bytes_at(self.fd, head, 0)
            os.ftruncate(self.fd, len(head) + sum(s.nbytes for s in ordered))
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, value: torch.Tensor) -> None:
        write_at(self.fd, value.contiguous().view(-1).view(torch.uint8), self.offsets[name])

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        remove_quietly(self.tmp)


class ShardWriter:
    """Writes a plan's files into ``directory`` in ``layout`` (or, with ``single_file``, everything as that one
    file): ``add(name, tensor)`` for every planned tensor in any order, then ``finish()``; ``abort()`` removes the
    temporary files of a failed write. Each file is renamed into place as soon as its last tensor arrives."""

    def __init__(self, plan: ShardPlan, directory: Path, layout: FileLayout = SAFETENSORS,
                 single_file: Path | None = None) -> None:
        if single_file is not None and len(plan.shards) != 1:
            raise ZinfError(f"a single file ({single_file}) was asked for a plan of {len(plan.shards)} shards")
        self.plan, self.layout = plan, layout
        names = layout.names(len(plan.shards))
        self.files = [single_file] if single_file is not None else [directory / n for n in names]
        self.index_file = directory / layout.index if len(self.files) > 1 else None
        self.tied_json = json.dumps(plan.tied, sort_keys=True) if plan.tied else None
        self.aliases: dict[str, list[str]] = {}
        for alias, kept in plan.tied.items():
            self.aliases.setdefault(kept, []).append(alias)
        self.remaining = [len(specs) for specs in plan.shards]
        self.streams: dict[int, _StreamedShard] = {}
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.added: set[str] = set()
        self.written: list[Path] = []
        self.written_bytes = 0

    def _tmp(self, path: Path) -> Path:
        return path.with_name(path.name + ".tmp")

    def add(self, name: str, value: torch.Tensor) -> None:
        index, spec = self.plan.shard_of[name], self.plan.by_name[name]
        if tuple(value.shape) != spec.shape or name in self.added:
            raise ZinfError(f"{name} arrived (again?) with shape {tuple(value.shape)}; the plan has {spec.shape} once")
        self.added.add(name)
        value = value.detach().to("cpu", spec.dtype)
        if self.layout.format == "safetensors":
            if index not in self.streams:
                self.streams[index] = _StreamedShard(self._tmp(self.files[index]), self.plan.shards[index],
                                                     self._metadata())
            self.streams[index].write(name, value)
        else:
            if value.untyped_storage().nbytes() != value.nbytes:  # a view: hold its own bytes, not its base's
                value = value.clone()
            shard = self.held.setdefault(index, {})
            shard[name] = value
            for alias in self.aliases.get(name, ()):
                shard[alias] = value
        self.written_bytes += spec.nbytes
        self.remaining[index] -= 1
        if self.remaining[index] == 0:
            self._complete(index)

    def _metadata(self) -> dict[str, str]:
        metadata = {"format": "pt"}
        if len(self.files) == 1 and self.tied_json is not None:
            metadata["zinf_tied"] = self.tied_json
        return metadata

    def _complete(self, index: int) -> None:
        final = self.files[index]
        tmp = self._tmp(final)
        if self.layout.format == "safetensors":
            stream = self.streams.pop(index, None) or _StreamedShard(tmp, self.plan.shards[index], self._metadata())
            stream.close()
        else:
            with open(tmp, "wb") as f:
                torch.save(self.held.pop(index, {}), f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
        self.written.append(final)

    def finish(self) -> list[Path]:
        """Write what is left (only an empty model leaves a shard unwritten here) and the index; returns the paths
        written, the index last."""
        missing = [s.name for s in self.plan.specs if s.name not in self.added]
        if missing:
            raise ZinfError(f"tensors {missing[:4]} were planned but never written")
        for index, count in enumerate(self.remaining):
            if count == 0 and self.files[index] not in self.written:
                self._complete(index)
        if self.index_file is not None:
            metadata: dict[str, object] = {"total_size": self.plan.total_bytes}
            if self.tied_json is not None:
                metadata["zinf_tied"] = self.tied_json
            weight_map = {s.name: self.files[i].name for i, specs in enumerate(self.plan.shards) for s in specs}
            if self.layout.format == "torch":
                weight_map.update({alias: weight_map[kept] for alias, kept in self.plan.tied.items()})
            tmp = self._tmp(self.index_file)
            text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
            tmp.write_text(text + "\n")
            os.replace(tmp, self.index_file)
            self.written.append(self.index_file)
        return self.written

    def abort(self) -> None:
        """Close and remove the temporary files (files already complete stay)."""
        for stream in self.streams.values():
            stream.abort()
        self.streams.clear()
        self.held.clear()
        for path in [*self.files, *([self.index_file] if self.index_file else [])]:
            remove_quietly(self._tmp(path))
