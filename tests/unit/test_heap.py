"""zinf/heap.py: what a ``HeapTrimmer`` counts (not a block of ``HEAP_BLOCK_MAX`` or more, which glibc unmaps when it is
freed) and when it trims."""

from __future__ import annotations

from zinf.heap import HEAP_BLOCK_MAX, HeapTrimmer
from zinf.report import StepTimers


def test_counts_small_blocks_and_trims_every_so_many_bytes() -> None:
    timers = StepTimers()
    trimmer = HeapTrimmer(10 << 20, timers)
    trimmer.count_block(HEAP_BLOCK_MAX)  # went back by itself: not counted
    assert trimmer.trims == 0
    for _ in range(4):
        trimmer.count_block(3 << 20)
    assert trimmer.trims == 1  # at 12 MiB
    trimmer.flush()  # the caller's time, not heap_trim's
    assert trimmer.trims == 2
    seconds, counts = timers.take()
    assert counts["heap_trim"] == 1 and seconds["heap_trim"] >= 0


def test_turned_off_it_never_trims() -> None:
    trimmer = HeapTrimmer(0)
    for _ in range(100):
        trimmer.count_block(1 << 20)
        trimmer.count(1 << 30)
    trimmer.flush()
    assert trimmer.trims == 0


def test_after_backward_trims_once_timed_when_it_trims_at_all() -> None:
    timers = StepTimers()
    trimmer = HeapTrimmer(64 << 20, timers)
    trimmer.after_backward()
    assert trimmer.trims == 1 and timers.take()[1]["heap_trim"] == 1
    off = HeapTrimmer(0, timers)
    off.after_backward()
    assert off.trims == 0 and "heap_trim" not in timers.take()[1]

