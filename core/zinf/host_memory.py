"""The engine's transient host bytes during a step (parameters gathered, gradients being assembled), their
high-water mark, and what happens to them when they are freed.

[Note: host bytes accounted]
What the engine holds in host memory at the end of a step is measured from its tensors (``resident_bytes()``:
the pinned pool, shared-memory segments, host shards, masters and optimizer states). During the step more comes
and goes: with the CPU computing, every unit's full parameters while it is gathered (prefetched ones too) and every
group's flat gradient from its first parameter's gradient until its reduce-scatter is done. ``HostMemory`` is
told of each of those as it is allocated and freed and keeps the largest sum the step reached; the step report's
``peak_host_bytes`` is that sum plus what is resident at the end of the step (``zinf/peak_host_bytes`` in its
metrics). Not the engine's and not counted: the model's activations, the autograd engine's own temporaries (a
parameter's gradient before it is added into its group's flat gradient), the Python objects of the model.

Freed memory only leaves the process's resident set when the allocator hands it back ([Note: heap growth] in
zinf/heap.py): where the engine trims the heap (CPU compute, parameters offloaded) it trims during the step and once
more at the end of every backward, so that between steps the resident set is what the engine accounts for.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from zinf.heap import HeapTrimmer

__all__ = ["HostMemory"]


class HostMemory:
    """Counts the engine's transient host bytes by kind ("gathered", "grad_buffers") and their high-water mark;
    tells ``heap`` of every freed block. Device memory (a GPU's) is not counted: pass the tensor's device."""

    def __init__(self, heap: HeapTrimmer | None = None) -> None:
        self.heap = heap if heap is not None else HeapTrimmer(0)
        self.held: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0

    def allocated(self, kind: str, nbytes: int, device: torch.device) -> None:
        if device.type != "cpu" or not nbytes:
            return
        self.held[kind] += nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)

    def freed(self, kind: str, nbytes: int, device: torch.device, kept: bool = False) -> None:
        """``kept``: the block went to the gather buffer cache, not back to the heap (nothing there to trim)."""
        if device.type != "cpu" or not nbytes:
            return
        self.held[kind] -= nbytes
        self.total -= nbytes
        if not kept:
            self.heap.count_block(nbytes)

    def take_peak(self) -> int:
        """The high-water mark since the last call; the next one starts from what is held now."""
        peak, self.peak = self.peak, self.total
        return peak
