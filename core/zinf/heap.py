"""Give freed host memory back to the operating system while a model is built or loaded.

[Note: heap growth]
Building and loading a model frees many large, short-lived tensors (a module's full values before they are
partitioned, a slice read from a file). glibc serves them from its heap once its mmap threshold has grown past
their size, and keeps what they free, which can grow the process by more than the model's own size (measured:
docs/benchmarks.md, "Measurements behind the defaults"). ``HeapTrimmer`` calls ``malloc_trim(0)`` after every
64 MiB freed this way (a few milliseconds each), which hands the free pages back; elsewhere (not glibc) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["HeapTrimmer", "trim_heap"]

_TRIM_EVERY_BYTES = 64 << 20

try:
    _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _trim = None


def trim_heap() -> None:
    """Hand the heap's free pages back to the system now (``malloc_trim(0)``; nothing elsewhere than glibc)."""
    if _trim is not None:
        _trim(0)


class HeapTrimmer:
    """Counts the bytes of the transient tensors of a build or load; trims the heap every ``every_bytes``."""

    def __init__(self, every_bytes: int = _TRIM_EVERY_BYTES) -> None:
        self.every_bytes = every_bytes
        self._since = 0

    def count(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every_bytes:
            self.trim()

    def trim(self) -> None:
        self._since = 0
        trim_heap()
