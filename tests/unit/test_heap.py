"""zinf/heap.py: what a ``HeapTrimmer`` counts (not a block of ``HEAP_BLOCK_MAX`` or more, which glibc unmaps when it is
freed) and when it trims; ``map_large_blocks`` fixing glibc's mmap threshold."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

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


_MAPPED_PROBE = r"""
import ctypes, ctypes.util
from zinf.heap import MMAP_THRESHOLD, map_large_blocks, trim_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped(nbytes):
    # glibc's chunk header, the word before the block: bit 1 (IS_MMAPPED) set for a block of its own mapping
    libc.free(libc.malloc(4 * nbytes))  # a large block freed: glibc raises its threshold past nbytes
    trim_heap()  # the heap's top handed back, so that only a new mapping or heap grown can hold the next block
    p = libc.malloc(nbytes)
    flag = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2
    libc.free(p)
    return bool(flag)

before = mapped(2 * MMAP_THRESHOLD)
assert map_large_blocks()
print(before, mapped(2 * MMAP_THRESHOLD))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_map_large_blocks_stops_glibc_growing_the_heap_for_large_blocks() -> None:
    """Without it a block above the threshold is served by growing the heap once a larger block was freed; with it
    the same block is a mapping of its own ([Note: heap growth] in zinf/heap.py). In a fresh process: the setting is
    for the whole process."""
    out = subprocess.run([sys.executable, "-c", _MAPPED_PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
