"""The safetensors header: what a file written as a stream (tensor sizes known first, bytes written as they come)
puts before its data. Shared by checkpoint parts (zinf/checkpoint/part_file.py) and model exports
(zinf/checkpoint/shard_writer.py).

A safetensors file is an 8-byte little-endian header length, a JSON header (``__metadata__``: str -> str, then
each tensor's ``dtype``, ``shape`` and ``data_offsets`` into the data), padded with spaces to a multiple of 8,
then the tensors' bytes back to back with no gaps.
"""

from __future__ import annotations

import json
import struct
from typing import Iterable, Sequence

import torch

from zinf.errors import CheckpointError

__all__ = ["TensorSpec", "DTYPE_NAMES", "DTYPES_BY_NAME", "build_header", "widest_first"]

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.uint32: "U32"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


class TensorSpec:
    """A tensor's name, dtype and shape: what a header records before the bytes are written."""

    __slots__ = ("name", "dtype", "shape")

    def __init__(self, name: str, dtype: torch.dtype, shape: Iterable[int]) -> None:
        if dtype not in DTYPE_NAMES:
            raise CheckpointError(f"zinf checkpoint: tensor {name} has dtype {dtype}, which a safetensors file cannot "
                                  f"hold here (supported: {', '.join(str(d) for d in DTYPE_NAMES)}).")
        self.name, self.dtype, self.shape = name, dtype, tuple(int(s) for s in shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"TensorSpec({self.name!r}, {self.dtype}, {self.shape})"


def widest_first(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """File order: by element size, widest first (stable), so every tensor starts at a multiple of its element size."""
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


def build_header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The length prefix and padded JSON header for ``specs`` stored back to back in this order, and each tensor's
    byte offset from the start of the data (which begins at ``len(header)``)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offsets: dict[str, int] = {}
    pos = 0
    for s in specs:
        header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        offsets[s.name] = pos
        pos += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, offsets
