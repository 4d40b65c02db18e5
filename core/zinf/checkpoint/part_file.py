"""One rank's part of a sharded checkpoint on disk: a safetensors file written as a stream, read by byte range.

[Note: part file]
A part is a valid safetensors file (``safetensors.safe_open`` reads it; so can any tool that reads the format):
an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the
tensors' bytes back to back. zinf writes it in one pass without holding the rank's state: every tensor's size is
known before any is written (the group layout fixes them), so the header goes first and each tensor is written
as the engine reads it from its tier (an NVMe-resident master or optimizer state never sits in memory whole).
Tensors are ordered by element size, widest first, so every tensor starts at a multiple of its element size.

Integrity: each tensor is cut into chunks of ``CHUNK`` bytes and the CRC32C of every chunk is stored in the
tensor ``zinf.checksums`` (uint32, written last, position fixed up front), whose last entry is the CRC32C of the
header itself. A reader checks the chunks it reads, so a rank that takes a slice of another rank's shard (a
resharded load) reads and checks only the chunks covering it: at most one chunk more at each end.

The engine's other values (format, world, rank, group layout, optimizer hyper-parameters and step counts, loss
scaler, step) are the record ``zinf.meta``, JSON with its tensors stored as tensors (see [Note: a record that is
data] in zinf/checkpoint/record.py); the client state is ``zinf.client_state``, a torch file read with
``weights_only`` (see [Note: client state loading] in zinf/checkpoint/client_state.py). Both are covered by the
same checksums, a foreign safetensors file (no ``zinf.meta``) is told apart at once, and opening a part runs no
code. A part of the earlier format (``zinf-sharded-v2``: both pickled) is opened only with ``allow_pickle``.
Why safetensors rather than torch's distributed checkpoint: DCP plans a save from whole state-dict objects and
reshards DTensors by their placements; zinf's state is flat per group shards streamed from three tiers, and a
resharded read is a byte range of a flat shard, which safetensors' explicit offsets give directly (read with
``pread``, no memory map whose touched pages would count in the reader's RSS).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import torch

from zinf import native
from zinf.checkpoint.client_state import ALLOW_PICKLE_HINT, dump_client_state, load_client_state
from zinf.checkpoint.record import RECORD, TENSOR_PREFIX, decode_record, encode_record
from zinf.checkpoint.safetensors_header import DTYPES_BY_NAME, TensorSpec, build_header, widest_first
from zinf.errors import CheckpointError
from zinf.file_io import read_at, remove_quietly, write_at, write_bytes_at

__all__ = ["PartWriter", "PartReader", "TensorSpec", "CHUNK", "META", "CLIENT_STATE", "CHECKSUMS", "PICKLED_FORMAT",
           "payload", "bytes_tensor"]

CHUNK = 4 << 20  # bytes covered by one CRC32C
META = RECORD
CLIENT_STATE = "zinf.client_state"
CHECKSUMS = "zinf.checksums"
PICKLED_FORMAT = "zinf-sharded-v2"  # the earlier format: record and client state pickled
_FORMAT_KEY = "zinf_format"


def _chunks(nbytes: int) -> int:
    return (nbytes + CHUNK - 1) // CHUNK


def bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def payload(meta: dict[str, Any], client_state: Any) -> dict[str, torch.Tensor]:
    """The tensors a part holds besides the state: the record (JSON), the tensors it refers to, the client
    state (a torch file)."""
    text, tensors = encode_record(meta)
    return {META: bytes_tensor(text), **tensors, CLIENT_STATE: bytes_tensor(dump_client_state(client_state))}


class PartWriter:
    """Writes one part: ``PartWriter(file, specs, payload(meta, client_state), format_name)``, then
    ``write(name, tensor)`` for every spec in any order, then ``finish()``. ``file`` must not exist (a fresh name:
    nothing current is overwritten)."""

    def __init__(self, file: Path, specs: list[TensorSpec], extra: dict[str, torch.Tensor], format_name: str) -> None:
        specs = [*specs, *(TensorSpec(name, t.dtype, t.shape) for name, t in extra.items())]
        names = [s.name for s in specs]
        if len(set(names)) != len(names) or CHECKSUMS in names:
            raise CheckpointError(f"zinf checkpoint: duplicate tensor names in a part ({sorted(names)[:4]} ...)")
        chunk_count = sum(_chunks(s.nbytes) for s in specs) + 1  # + the header's own (not the checksums')
        specs.append(TensorSpec(CHECKSUMS, torch.uint32, (chunk_count,)))
        ordered = widest_first(specs)
        head, self._offset = build_header(ordered, {_FORMAT_KEY: format_name})
        self._first_chunk: dict[str, int] = {}
        self._spec = {s.name: s for s in specs}
        chunk = 0
        for s in ordered:  # checksum order: file order (the checksums' own chunk stays 0), then the header
            self._first_chunk[s.name] = chunk
            chunk += _chunks(s.nbytes) if s.name != CHECKSUMS else 0
        text = head[8:]
        self._data_start = 8 + len(text)
        self._crcs = torch.zeros(chunk_count, dtype=torch.uint32)
        self._crcs[-1] = native.crc32c(text)
        self.file = file
        self._pending = set(self._spec) - {CHECKSUMS}
        self._fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_bytes_at(self._fd, head, 0)
            for name, tensor in extra.items():
                self.write(name, tensor)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._spec[name]
        t = tensor.detach()
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise CheckpointError(f"zinf checkpoint: {name} is {t.dtype} {tuple(t.shape)}, the part's header "
                                  f"planned {spec.dtype} {spec.shape}.")
        data = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        first = self._first_chunk[name]
        for k in range(_chunks(spec.nbytes)):
            self._crcs[first + k] = native.crc32c(data[k * CHUNK : (k + 1) * CHUNK])
        write_at(self._fd, data, self._data_start + self._offset[name])
        self._pending.discard(name)

    def finish(self) -> None:
        """Write the checksums, flush and fsync; every planned tensor must have been written."""
        try:
            if self._pending:
                raise CheckpointError(f"zinf checkpoint: tensors {sorted(self._pending)[:4]} were planned but not "
                                      f"written to {self.file}.")
            write_at(self._fd, self._crcs.view(torch.uint8), self._data_start + self._offset[CHECKSUMS])
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = -1

    def abort(self) -> None:
        """Close and remove the file (a failed write leaves nothing behind)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        remove_quietly(self.file)


class PartReader:
    """Reads tensors, whole or an element range of their flat view, from one part, checking the chunks read.
    ``meta`` is the engine's record, ``client_state()`` the client state. A part of the earlier, pickled format
    opens only with ``allow_pickle`` (``pickled`` is then True)."""

    def __init__(self, file: Path, format_name: str, allow_pickle: bool = False) -> None:
        self.file = file
        self.allow_pickle = allow_pickle
        try:
            self._fd = os.open(file, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CheckpointError(f"zinf checkpoint: cannot open {file} ({exc}).") from exc
        try:
            self._parse(format_name)
        except BaseException:
            self.close()
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"zinf checkpoint: {self.file} is {why}. Nothing was loaded; restore the file from a "
                               "copy or load another checkpoint.")

    def _parse(self, format_name: str) -> None:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("truncated or not a checkpoint part (shorter than a safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 1 << 30):
            raise self._bad("truncated or not a checkpoint part (its header length exceeds the file)")
        text = os.pread(self._fd, length, 8)
        try:
            header = json.loads(text)
            found = header.get("__metadata__", {}).get(_FORMAT_KEY)
        except (ValueError, AttributeError) as exc:
            raise self._bad(f"not a checkpoint part (its header is not safetensors JSON: {exc})") from exc
        self.pickled = found == PICKLED_FORMAT
        if self.pickled and not self.allow_pickle:
            raise CheckpointError(
                f"zinf checkpoint: {self.file} is a {PICKLED_FORMAT} part, written by an earlier zinf that stored the "
                "record and the client state as pickles, which can run any code when read; it is not opened unless "
                f"you trust it. If you trust whoever wrote it, convert it once with 'zinf upgrade-checkpoint "
                f"{self.file.parent}' (afterwards it loads like any checkpoint), or read it as it is: "
                f"{ALLOW_PICKLE_HINT} (zinf consolidate: --allow-pickle).")
        if found != format_name and not self.pickled:
            what = f"a {found} part (another zinf version)" if found else "a safetensors file, not a zinf checkpoint part"
            raise CheckpointError(f"zinf checkpoint: {self.file} is {what}; this zinf reads {format_name}. Load it "
                                  "with the zinf that wrote it (or consolidate it there with 'zinf consolidate').")
        self._data_start = 8 + length
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end = 0
        try:
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                a, b = (int(x) for x in info["data_offsets"])
                dtype, shape = DTYPES_BY_NAME[info["dtype"]], tuple(int(d) for d in info["shape"])
                if not 0 <= a <= b or b - a != math.prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
                    raise ValueError(f"{name}: bytes {a}-{b} for {str(dtype).removeprefix('torch.')} {list(shape)}")
                self._entries[name] = (dtype, shape, a, b)
                end = max(end, b)
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"damaged (a header entry is malformed: {exc})") from exc
        if self._data_start + end > size:
            raise self._bad(f"truncated ({size} bytes, its header describes {self._data_start + end})")
        if CHECKSUMS not in self._entries or META not in self._entries:
            raise self._bad("damaged (its checksums or its record are missing)")
        dtype, shape, a, b = self._entries[CHECKSUMS]
        if b - a < 4 or (b - a) % 4:
            raise self._bad(f"damaged (its checksums take {b - a} bytes, not a whole number of CRC32Cs)")
        raw = torch.empty(b - a, dtype=torch.uint8)
        read_at(self._fd, raw, self._data_start + a)
        self._crcs = raw.view(torch.uint32)
        if int(self._crcs[-1]) != native.crc32c(text):
            raise self._bad("corrupted: its header does not match its checksum")
        self._first_chunk: dict[str, int] = {}
        chunk = 0
        for name in sorted(self._entries, key=lambda n: self._entries[n][2]):  # file order, as written
            self._first_chunk[name] = chunk
            chunk += _chunks(self._entries[name][3] - self._entries[name][2]) if name != CHECKSUMS else 0
        if chunk + 1 != self._crcs.numel():
            raise self._bad("damaged (its checksums do not cover its tensors)")
        self.meta: dict[str, Any] = self._record()

    def _record(self) -> dict[str, Any]:
        if self.pickled:  # opened with allow_pickle: the user trusts the file
            return pickle.loads(self._read_bytes(META))
        try:
            meta = decode_record(self._read_bytes(META), self.read)
        except ValueError as exc:
            raise self._bad(f"damaged: its record (zinf.meta) is not zinf's JSON record ({exc}); a record that is not "
                            "data is never unpickled") from None
        if not isinstance(meta, dict):
            raise self._bad(f"damaged: its record (zinf.meta) is a JSON {type(meta).__name__}, not an object")
        return meta

    def _read_bytes(self, name: str) -> bytes:
        return self.read(name).numpy().tobytes()

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return [n for n in self._entries if n not in (META, CLIENT_STATE, CHECKSUMS) and not n.startswith(TENSOR_PREFIX)]

    def spec(self, name: str) -> TensorSpec:
        """Tensor ``name``'s dtype and shape, from the header (nothing read)."""
        dtype, shape, _, _ = self._entries[name]
        return TensorSpec(name, dtype, shape)

    def numel(self, name: str) -> int:
        dtype, _, a, b = self._entries[name]
        return (b - a) // dtype.itemsize

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name``'s flat view (the whole tensor, in its shape, by default)."""
        if name not in self._entries:
            raise self._bad(f"missing tensor {name}")
        dtype, shape, a, b = self._entries[name]
        whole = hi is None and lo == 0
        size = dtype.itemsize
        hi = (b - a) // size if hi is None else hi
        first, last = (lo * size) // CHUNK, -(-(hi * size) // CHUNK)
        start, stop = first * CHUNK, min(last * CHUNK, b - a)
        raw = torch.empty(max(0, stop - start), dtype=torch.uint8)
        got = read_at(self._fd, raw, self._data_start + a + start)
        if got != raw.numel():
            raise self._bad(f"truncated (tensor {name} ends past the end of the file)")
        base = self._first_chunk[name]
        for k in range(first, last) if name != CHECKSUMS else ():
            piece = raw[(k - first) * CHUNK : (k - first + 1) * CHUNK]
            if piece.numel() and native.crc32c(piece) != int(self._crcs[base + k]):
                raise self._bad(f"corrupted: tensor {name} ({b - a} bytes, {dtype}) fails its checksum at bytes "
                                f"{k * CHUNK}..{k * CHUNK + piece.numel()}")
        out = raw[lo * size - start : hi * size - start].view(dtype)
        return out.view(shape) if whole else out

    def client_state(self, allow_pickle: bool = False) -> Any:
        """The client state (see [Note: client state loading] in zinf/checkpoint/client_state.py); any Python
        object with ``allow_pickle`` (the user trusts the file), else only data and the allowed types."""
        data = self._read_bytes(CLIENT_STATE) if CLIENT_STATE in self._entries else b""
        if self.pickled:
            return pickle.loads(data) if data else {}
        return load_client_state(data, self.file, allow_pickle or self.allow_pickle)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "PartReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
