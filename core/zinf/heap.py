"""Give freed host memory back to the operating system while a model is built or loaded, and while it trains on the
CPU with its parameters offloaded.

[Note: heap growth]
Building and loading a model frees many large, short-lived tensors (a module's full values before they are
partitioned, a slice read from a file). glibc serves them from its heap once its mmap threshold has grown past
their size, and keeps what they free, which can grow the process by more than the model's own size (measured:
docs/benchmarks.md, "Measurements behind the defaults"). ``HeapTrimmer`` calls ``malloc_trim(0)`` after every
64 MiB freed this way (a few milliseconds each), which hands the free pages back; elsewhere (not glibc) it does
nothing.

Training on the CPU frees the same way, every step: each unit's gathered parameters after its forward and its
backward, its gradients after their reduce-scatter. The engine counts those into one ``HeapTrimmer``
(``trim_heap_bytes``, 64 MiB by default), which also trims at the end of the engine's build, where host memory is
what the run is short of (``trims_host_heap`` in zinf/host_room.py): the compute device is the CPU (on a GPU they
are device memory), the parameters are offloaded, and ``offload.max_cpu_bytes`` states a budget or the ranks of
this host gather models larger than a quarter of the memory their placements leave free (a cgroup's limit
counted). Elsewhere nothing is trimmed: handing
pages back costs page faults when they are touched again (measured: docs/offload.md, "Overlap: NVMe step against
the in-memory step"). It trims once more at
the end of every backward (``after_backward``: the activations and the last gradients were freed), which lowers RSS
between steps to the engine's own account ([Note: host bytes accounted] in zinf/host_memory.py), not the peak.
Gathers whose memory the gather buffer cache keeps are not counted ([Note: gather buffer cache] in
zinf/native/buffer_cache.py): it never goes back to the heap. What
it saves on a Trainer full fine-tune with everything on NVMe: docs/offload.md, "Host memory of a Trainer full
fine-tune".

Trimming alone leaves the blocks freed since the last trim in the heap, and the holes they leave: glibc raises its
mmap threshold to the size of every large block freed (up to 32 MiB), so after the first step a block below that
grows the heap whenever no free chunk holds it. An engine that trims therefore also fixes glibc's threshold at 1 MiB
(``map_large_blocks``: ``mallopt(M_MMAP_THRESHOLD)``, for the whole process and for good): a block of 1 MiB or more
that no free chunk holds is then a mapping of its own, unmapped when freed, at the cost of page faults when it is
touched, which the trims cost already. What it saves, at what step time: docs/offload.md, "Host memory of a Trainer
full fine-tune".
"""

from __future__ import annotations

import ctypes
import ctypes.util

from zinf.report import StepTimers

__all__ = ["HeapTrimmer", "map_large_blocks", "trim_heap"]

_TRIM_EVERY_BYTES = 64 << 20
# glibc's mmap threshold grows with the blocks freed, but never past 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit):
# a block that large is a mapping of its own, unmapped when freed, and never stays in the heap
HEAP_BLOCK_MAX = 32 << 20

# blocks of this size and more are mappings of their own once an engine trims the heap ([Note: heap growth])
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim, _mallopt = _libc.malloc_trim, _libc.mallopt
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _trim = _mallopt = None


def trim_heap() -> None:
    """Hand the heap's free pages back to the system now (``malloc_trim(0)``; nothing elsewhere than glibc)."""
    if _trim is not None:
        _trim(0)


def map_large_blocks() -> bool:
    """Make a later allocation of ``MMAP_THRESHOLD`` bytes or more that the heap's free chunks cannot hold a mapping
    of its own, unmapped when freed, instead of grown heap (glibc only; True where it took effect). For the whole
    process: [Note: heap growth]."""
    return _mallopt is not None and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


class HeapTrimmer:
    """Counts the bytes of the transient tensors of a build, a load or a step; trims the heap every ``every_bytes``
    (0: never), timed as ``heap_trim`` in ``timers`` when given."""

    def __init__(self, every_bytes: int = _TRIM_EVERY_BYTES, timers: StepTimers | None = None) -> None:
        self.every_bytes = every_bytes
        self.timers = timers
        self.trims = 0
        self._since = 0

    def start(self, every_bytes: int) -> None:
        """Trim every ``every_bytes`` from now on (0: never), with glibc's mmap threshold fixed
        (``map_large_blocks``) where it trims."""
        self.every_bytes = every_bytes
        if every_bytes:
            map_large_blocks()

    def count_block(self, nbytes: int) -> None:
        """One block of ``nbytes`` was freed: counted unless it was large enough to go back by itself."""
        if nbytes < HEAP_BLOCK_MAX:
            self.count(nbytes)

    def count(self, nbytes: int) -> None:
        if not self.every_bytes:
            return
        self._since += nbytes
        if self._since >= self.every_bytes:
            self.trim()

    def after_backward(self) -> None:
        """The end of a backward: its activations and the last gradients were freed, which the next forward would
        find in the heap, and between steps the resident set is the engine's account ([Note: host bytes accounted]
        in zinf/host_memory.py). Timed as ``heap_trim``."""
        if self.every_bytes:
            self.trim()

    def flush(self) -> None:
        """Trim now if this trimmer trims at all: at the end of a build, where what was freed but not counted is let
        go too. Not timed as ``heap_trim`` (the forward's and backward's trims, outside ``compute``)."""
        if self.every_bytes:
            self.trim(timed=False)

    def trim(self, timed: bool = True) -> None:
        self._since = 0
        self.trims += 1
        if not timed or self.timers is None:
            trim_heap()
            return
        with self.timers.time("heap_trim"):
            trim_heap()
