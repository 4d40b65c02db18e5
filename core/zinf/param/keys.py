"""What the parts below a flat group know of it: enough to key their state by it and size their buffers.

The stores (``store.py``), the update fence (``fence.py``) and the gradient shard (``grad_shard.py``) are handed the
group itself, but read only this: typed against :class:`GroupKey`, they do not import the group's module, which
imports them.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["GroupKey"]


class GroupKey(Protocol):
    """A flat group as its store, its fence and its gradient shard see it."""

    name: str  # the module's qualified name: profiler ranges and errors
    device: torch.device  # the compute device
    shard_numel: int  # elements of this rank's shard (the same on every rank)
    storage_dtype: torch.dtype  # the shard's dtype at rest
    shard: torch.Tensor | None  # the shard the group holds itself (device tier); None once a store took it
    shard_nbytes: int  # bytes of that shard at rest (``shard_numel`` elements, or 4-bit codes and scales)

    def shard_values(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard as fp32 values (widened, or decoded from 4 bits)."""
        ...
