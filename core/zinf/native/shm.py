"""Flags in shared memory: wraps ``zinf._native.shm`` (stub: ``_native_shm.pyi`` beside this file).

The ranks of one host signal each other through 32-bit sequence numbers in a file they all map
(see [Note: same-host collectives] in zinf/runtime/same_host.py):

- :func:`post`: every store before it is made visible, then the flag is set and its waiters woken;
- :func:`mark_closed`: a rank's mark that it closed its transport (its flag never moves again), waking its waiters;
- :func:`wait_all`: wait until every flag reached a sequence number (spin, then a futex sleep), with a timeout,
  noticing a waited-for rank that closed or whose process exited.

There is no pure-Python fallback: Python cannot order its stores against another process's loads.
Without the extension, :func:`available` is False and the collectives go through the process group.
"""

from __future__ import annotations

import enum
from typing import Sequence

from .loader import _native

__all__ = ["Outcome", "available", "mark_closed", "post", "wait_all"]


class Outcome(enum.IntEnum):
    """How :func:`wait_all` ended (``zinf::shm::Outcome``)."""

    REACHED = 0  # every flag reached the sequence number
    TIMED_OUT = 1
    EXITED = 2  # the waited-for rank's process exited
    CLOSED = 3  # the waited-for rank closed its transport


def available() -> bool:
    return _native is not None


def post(flag: int, seq: int) -> None:
    """Set the flag at address ``flag`` to ``seq`` (modulo 2**32) once every earlier store is visible."""
    assert _native is not None, "zinf.native.shm needs the C++ extension (check available() first)"
    _native.shm.post(flag, seq & 0xFFFFFFFF)


def mark_closed(closed: int, flag: int) -> None:
    """Set the 32-bit word at address ``closed`` to 1 once every earlier store (the last :func:`post`) is visible,
    and wake the ranks sleeping on ``flag``."""
    assert _native is not None, "zinf.native.shm needs the C++ extension (check available() first)"
    _native.shm.mark_closed(closed, flag)


def wait_all(flags: Sequence[int], closed: Sequence[int], pids: Sequence[int], seq: int, timeout_s: float,
             spins: int = 0) -> tuple[Outcome, int]:
    """Wait until every flag reached ``seq``, checking each up to ``spins`` times before sleeping on it; before each
    sleep on flag i, whether ``closed[i]`` was marked (:func:`mark_closed`), and every fifth of a second, whether
    process ``pids[i]`` still runs (empty ``closed`` or ``pids``: no such check). (REACHED, -1) when all did;
    (TIMED_OUT, i) when flag i had not after ``timeout_s``; (CLOSED, i) or (EXITED, i) when its rank closed or its
    process exited first."""
    assert _native is not None, "zinf.native.shm needs the C++ extension (check available() first)"
    outcome, index = _native.shm.wait_all(list(flags), list(closed), list(pids), seq & 0xFFFFFFFF, float(timeout_s),
                                          int(spins))
    return Outcome(outcome), int(index)
