"""Byte sizes as people read them in messages."""

from __future__ import annotations

__all__ = ["format_bytes", "format_bytes_apart"]

_KiB, _MiB, _GiB = 1 << 10, 1 << 20, 1 << 30


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest unit it fills: "1.50 GiB", "3.25 MiB", "12.0 KiB", "512 bytes"."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n >= _GiB:
        return f"{n / _GiB:.2f} GiB"
    if n >= _MiB:
        return f"{n / _MiB:.2f} MiB"
    if n >= _KiB:
        return f"{n / _KiB:.1f} KiB"
    return f"{n} bytes"


def format_bytes_apart(a: int, b: int) -> tuple[str, str]:
    """Two sizes that a message compares ("needs A but has B"), written so that they read differently
    whenever they differ: in exact bytes when rounding would print them the same."""
    shown = format_bytes(a), format_bytes(b)
    if a != b and shown[0] == shown[1]:
        return f"{a:,} bytes", f"{b:,} bytes"
    return shown
