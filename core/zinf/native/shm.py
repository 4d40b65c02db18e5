"""Flags in shared memory: wraps ``zinf._native.shm`` (stub: ``_native_shm.pyi`` beside this file).

The ranks of one host signal each other through 32-bit sequence numbers in a file they all map
(see [Note: same-host collectives] in zinf/runtime/same_host.py):

- :func:`post`: every store before it is made visible, then the flag is set and its waiters woken;
- :func:`wait_all`: wait until every flag reached a sequence number (spin, then a futex sleep), with a timeout,
  noticing a waited-for process that exited.

There is no pure-Python fallback: Python cannot order its stores against another process's loads.
Without the extension, :func:`available` is False and the collectives go through the process group.
"""

from __future__ import annotations

from typing import Sequence

from .loader import _native

__all__ = ["available", "post", "wait_all"]


def available() -> bool:
    return _native is not None


def post(flag: int, seq: int) -> None:
    """Set the flag at address ``flag`` to ``seq`` (modulo 2**32) once every earlier store is visible."""
    assert _native is not None, "zinf.native.shm needs the C++ extension (check available() first)"
    _native.shm.post(flag, seq & 0xFFFFFFFF)


def wait_all(flags: Sequence[int], pids: Sequence[int], seq: int, timeout_s: float, spins: int = 0) -> int:
    """Wait until every flag reached ``seq``, checking each up to ``spins`` times before sleeping on it, and while
    asleep on flag i, whether process ``pids[i]`` still runs (empty ``pids``: no such check). -1 when all did; i when
    flag i had not after ``timeout_s``; -2 - i when process ``pids[i]`` exited first."""
    assert _native is not None, "zinf.native.shm needs the C++ extension (check available() first)"
    return int(_native.shm.wait_all(list(flags), list(pids), seq & 0xFFFFFFFF, float(timeout_s), int(spins)))
