"""CRC32C content checksums: wraps ``zinf._native.checksum`` (stub: ``_native_checksum.pyi`` beside this file).

- :func:`crc32c`: the CRC32C (Castagnoli) of a tensor's or bytes-like object's bytes, chainable
  (SSE4.2 ``crc32`` instruction where the CPU has it, else C++ tables; GIL released).
- :func:`crc32c_combine`: the CRC of two ranges joined, from theirs.
- :func:`crc32c_py`: the pure-Python oracle, used when the extension is missing.
- :func:`checksum_backend`: "sse4.2", "portable" or "python".
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .loader import _native

__all__ = ["ContentCheck", "checksum_backend", "crc32c", "crc32c_combine", "crc32c_py"]


def _address(data: torch.Tensor | bytes | bytearray | memoryview) -> tuple[int, int, Any]:
    """(address, byte count, object keeping the memory alive) of a CPU tensor or a bytes-like object."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"crc32c: needs a contiguous CPU tensor, got {data.device} "
                             f"({'contiguous' if data.is_contiguous() else 'strided'})")
        return data.data_ptr(), data.numel() * data.element_size(), data
    import numpy as np  # a read-only buffer (bytes) without torch's non-writable-tensor warning

    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.ctypes.data, arr.size, arr


def crc32c_py(data: torch.Tensor | bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C in pure Python: the test oracle (about 1 MB/s), and what runs without the native build."""
    if isinstance(data, torch.Tensor):
        raw = data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if data.numel() else b""
    else:
        raw = bytes(data)
    table = _CRC_TABLE
    state = crc ^ 0xFFFFFFFF
    for byte in raw:
        state = (state >> 8) ^ table[(state ^ byte) & 0xFF]
    return state ^ 0xFFFFFFFF


def _crc_table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        out.append(c)
    return out


_CRC_TABLE = _crc_table()


def crc32c(data: torch.Tensor | bytes | bytearray | memoryview, crc: int = 0, threads: int = 1) -> int:
    """The CRC32C of ``data``'s bytes (a contiguous CPU tensor of any dtype, or bytes-like), continuing from
    ``crc``: ``crc32c(b, crc32c(a)) == crc32c(a + b)``. Native (GIL released), else :func:`crc32c_py`. With
    ``threads`` > 1, ranges of 4 MiB and more are cut into that many slices checksummed at once and joined
    (``crc32c_combine``): the same value."""
    if _native is None:
        return crc32c_py(data, crc)
    address, nbytes, _keep = _address(data)
    if threads > 1:
        return int(_native.checksum.crc32c_parallel(address, nbytes, crc, threads))
    return int(_native.checksum.crc32c(address, nbytes, crc))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32c(a + b)`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (native only)."""
    if _native is None:
        raise RuntimeError("crc32c_combine needs the native extension")
    return int(_native.checksum.crc32c_combine(crc1, crc2, len2))


def checksum_backend() -> str:
    """What :func:`crc32c` runs on: "sse4.2", "portable" (C++ tables) or "python"."""
    return "python" if _native is None else str(_native.checksum.backend())


class ContentCheck:
    """A shard's checksum that its store leaves to the copy reading its bytes next ([Note: one pass per byte] in
    zinf/offload/in_place.py): ``verify`` with the CRC32C that copy took runs ``passed`` where ``check`` takes it,
    and ``failed`` before re-raising where ``check`` refuses it (the store then drops the bytes, so a file put back
    is read again)."""

    __slots__ = ("_check", "_passed", "_failed")

    def __init__(self, check: Callable[[int], None], passed: Callable[[], None], failed: Callable[[], None]) -> None:
        self._check, self._passed, self._failed = check, passed, failed

    def verify(self, actual: int) -> None:
        try:
            self._check(actual)
        except BaseException:
            self._failed()
            raise
        self._passed()
