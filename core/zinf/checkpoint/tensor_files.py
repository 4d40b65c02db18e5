"""Read parts of tensors from weight files without reading the rest: safetensors (one file or sharded with an
index) and torch state-dict files (``torch.save``; read memory-mapped).

[Note: reading a slice]
A rank needs a contiguous range of a parameter's flattened elements (its slice of a flat group). The range is
read as the rows of the first dimension that cover it, then trimmed, so the bytes read are that range plus at most
one row on each side. From a safetensors file those rows are one ``pread`` of their bytes (the header gives each
tensor's offset) into a buffer of this process: a memory map would do too, but the file pages it touches count in
the process's resident memory until it is closed. A torch file is read memory-mapped. Nothing else of the file is
read: a rank's peak memory is its shards plus one such piece.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zinf.errors import CheckpointError
from zinf.file_io import read_at

__all__ = ["TensorFiles", "TensorInfo", "open_weights"]

_SAFE_INDEX = "model.safetensors.index.json"
_SAFE_SINGLE = "model.safetensors"
_TORCH_INDEX = "pytorch_model.bin.index.json"
_TORCH_SINGLE = "pytorch_model.bin"
_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the files: where it is, its shape and dtype."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = -1  # where its bytes start in a safetensors file
    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorFiles:
    """The tensors of a set of weight files, by name; reads any element range of one of them. See [Note: reading
    a slice]. ``bytes_read`` counts the bytes of the rows read."""

    def __init__(self, files: list[str], tensors: dict[str, TensorInfo], state: dict[str, torch.Tensor] | None = None,
                 torch_files: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        self.files = files
        self.tensors = tensors
        self.bytes_read = 0
        self._state = state  # an in-memory state dict: read from it directly
        self._fds: dict[str, int] = {}  # safetensors files, read with pread
        self._torch: dict[str, dict[str, torch.Tensor]] = dict(torch_files or {})  # memory-mapped torch files

    @property
    def from_state_dict(self) -> bool:
        """The tensors are an in-memory state dict's, not files'."""
        return self._state is not None

    def count_read(self, nbytes: int) -> None:
        """Bytes of these files read by someone else on the loader's behalf (frozen shards read in place)."""
        self.bytes_read += nbytes

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened, in the file's dtype. It may be a view of the
        file's memory map or of the caller's state dict: copy it, never write to it."""
        info = self.tensors[name]
        if end <= start:
            return torch.empty(0, dtype=info.dtype)
        shape = info.shape
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        r0, r1 = start // row, -(-end // row)
        if info.offset >= 0 and self._state is None:  # safetensors (a 0-d tensor is one row of one element)
            rows = self._pread(info, r0 * row, r1 * row)
        else:
            whole = self._state[name] if self._state is not None else self._torch[info.file][name]
            rows = whole[r0:r1] if shape else whole.reshape(1)
        flat = rows.reshape(-1)[start - r0 * row : end - r0 * row]
        self.bytes_read += rows.numel() * rows.element_size()
        return flat

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of tensor ``name`` flattened, into ``out`` (as many elements): read straight
        into it where it is contiguous host memory of the file's dtype and the file a safetensors one (no buffer,
        no copy), else copied from :meth:`read_range`."""
        info = self.tensors[name]
        if (end > start and info.offset >= 0 and self._state is None and out.device.type == "cpu"
                and out.dtype == info.dtype and out.is_contiguous()):
            nbytes = (end - start) * info.dtype.itemsize
            if read_at(self._fd(info.file), out, info.offset + start * info.dtype.itemsize) < nbytes:
                raise CheckpointError(f"zinf: {info.file} ends before its tensors do (truncated?).")
            self.bytes_read += nbytes
            return
        out.copy_(self.read_range(name, start, end))

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def _pread(self, info: TensorInfo, first: int, end: int) -> torch.Tensor:
        """Elements ``[first, end)`` of a safetensors tensor, read with one ``pread`` of their bytes."""
        out = torch.empty(end - first, dtype=info.dtype)
        if read_at(self._fd(info.file), out, info.offset + first * info.dtype.itemsize) < out.numel() * out.element_size():
            raise CheckpointError(f"zinf: {info.file} ends before its tensors do (truncated?).")
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._torch.clear()

    def __enter__(self) -> "TensorFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_torch(file: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a foreign or truncated file
        raise CheckpointError(f"zinf: cannot read {file} as a torch state dict ({type(exc).__name__}: {exc}). "
                              "Pass a safetensors file, a torch.save'd state dict, or a directory holding them.") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a Lightning-style checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"zinf: {file} holds no state dict of tensors (a {type(state).__name__}); pass the "
                              "model's weights (state_dict()) instead.")
    return state


def _safetensors_header(file: str) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes from a safetensors file's header, without reading any tensor."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > 100 << 20:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
        file_bytes = os.path.getsize(file)
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _SAFE_DTYPES:
                raise ValueError(f"dtype {meta['dtype']} of {name}")
            if 8 + size + meta["data_offsets"][1] > file_bytes:
                raise ValueError(f"{name} ends past the end of the file (truncated?)")
            out[name] = TensorInfo(file, tuple(meta["shape"]), _SAFE_DTYPES[meta["dtype"]], 8 + size + meta["data_offsets"][0])
        return out
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"zinf: {file} is not a readable safetensors file ({exc}). Check the download "
                              "(a truncated or foreign file), or pass another path.") from exc


def _index_files(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"zinf: {index} is not a weights index ({exc}).") from exc
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise CheckpointError(f"zinf: {index} names {len(missing)} file(s) that are not there ({missing[:3]}); "
                              "the checkpoint is incomplete: download or copy it again.")
    return [str(index.parent / f) for f in files]


def _weight_files(path: Path) -> list[str]:
    """The weight files of a checkpoint directory (HF layout) or a single file."""
    if path.is_file():
        return [str(path)]
    if not path.is_dir():
        raise CheckpointError(f"zinf: no weights at {path}: the path does not exist. Pass a directory written by "
                              "save_pretrained (or holding safetensors / torch weight files), or one such file.")
    for index in (_SAFE_INDEX, _TORCH_INDEX):
        if (path / index).is_file():
            return _index_files(path / index)
    for single in (_SAFE_SINGLE, _TORCH_SINGLE):
        if (path / single).is_file():
            return [str(path / single)]
    found = sorted(str(p) for p in path.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"zinf: no weight files in {path} (looked for {_SAFE_INDEX}, {_SAFE_SINGLE}, {_TORCH_INDEX}, "
                          f"{_TORCH_SINGLE}, *.safetensors). Pass the directory save_pretrained wrote.")


def open_weights(source: str | os.PathLike | list[str] | dict[str, torch.Tensor]) -> TensorFiles:
    """The tensors of ``source``: a checkpoint directory, one weight file, a list of weight files, or a state dict."""
    if isinstance(source, dict):
        bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"zinf: the state dict's values must be tensors; {bad[:3]} are not.")
        infos = {k: TensorInfo("<state dict>", tuple(v.shape), v.dtype) for k, v in source.items()}
        return TensorFiles([], infos, state=source)
    files = [str(f) for f in source] if isinstance(source, list) else _weight_files(Path(source))
    tensors: dict[str, TensorInfo] = {}
    torch_files: dict[str, dict[str, torch.Tensor]] = {}
    for f in files:
        if f.endswith(".safetensors"):
            found = _safetensors_header(f)
        else:
            torch_files[f] = _load_torch(f)
            found = {k: TensorInfo(f, tuple(v.shape), v.dtype) for k, v in torch_files[f].items()}
        dup = set(found) & set(tensors)
        if dup:
            raise CheckpointError(f"zinf: {sorted(dup)[:3]} appear in two weight files ({f} and "
                                  f"{tensors[next(iter(dup))].file}); the checkpoint is inconsistent.")
        tensors.update(found)
    return TensorFiles(files, tensors, torch_files=torch_files)
