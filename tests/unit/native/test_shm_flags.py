"""The flags of the same-host collectives (zinf/native/shm.py) in one process: a wait ends when every flag reached
its number, when the timeout passes, or at once when the waited-for rank marked itself closed before posting."""

from __future__ import annotations

import time

import pytest
import torch

from zinf.native import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="the native build is missing")


def _header() -> tuple[torch.Tensor, int, int]:
    """A zeroed header as a segment starts: (its memory, the flag's address, the closed mark's address)."""
    mem = torch.zeros(128, dtype=torch.uint8)
    return mem, mem.data_ptr(), mem.data_ptr() + 64


def test_a_wait_ends_when_the_flag_is_reached_or_after_the_timeout() -> None:
    mem, flag, closed = _header()
    shm.post(flag, 1)
    assert shm.wait_all([flag], [closed], [], 1, 5.0) == (shm.Outcome.REACHED, -1)
    start = time.monotonic()
    assert shm.wait_all([flag], [closed], [], 2, 0.05) == (shm.Outcome.TIMED_OUT, 0)
    assert time.monotonic() - start < 1.0


def test_a_closed_rank_fails_its_waiters_at_once_but_not_for_what_it_posted() -> None:
    mem, flag, closed = _header()
    other, other_flag, other_closed = _header()
    shm.post(flag, 1)
    shm.post(other_flag, 1)
    shm.mark_closed(other_closed, other_flag)  # its last post came first: that chunk is there to read
    assert shm.wait_all([flag, other_flag], [closed, other_closed], [], 1, 5.0) == (shm.Outcome.REACHED, -1)
    shm.post(flag, 2)
    start = time.monotonic()
    assert shm.wait_all([flag, other_flag], [closed, other_closed], [], 2, 30.0) == (shm.Outcome.CLOSED, 1)
    assert time.monotonic() - start < 1.0  # not the 30 s timeout
