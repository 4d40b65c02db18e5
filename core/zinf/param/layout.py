"""Where each parameter of a flat group lies in the flat vector and in this rank's shard.

[Note: flat layout]
The group's parameters are laid end to end in registration order (no per-parameter padding, except to the block
boundaries of a 4-bit group); the flat vector is padded at the end to a multiple of ``world`` and rank ``r`` keeps
elements ``[r * shard_numel, (r + 1) * shard_numel)``. An all-gather into one buffer of ``world *
shard_numel`` elements therefore rebuilds the flat vector with no copy, and each parameter's
``.data`` becomes a view of it. Gradients use the same layout, so a reduce-scatter of the flat
gradient lands each rank's slice in its gradient shard.

[Note: releasing memory]
Released parameters get ``.data`` set to a placeholder: one NaN element expanded (stride 0) to the
parameter's shape. ``shape``, ``dim()`` and ``numel()`` stay true for code that inspects parameters
(optimizer grouping, parameter counts), an in-place write raises, and a stray read yields NaN instead of
silently wrong numbers or freed memory. The full buffer's storage is resized to 0. Autograd may have saved views
of the full buffer (``weight.t()`` in a linear layer); resizing the shared storage frees those too,
and the next gather resizes it back, so the saved views read the gathered values again in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

__all__ = ["FlatLayout", "ParamSlot"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat vector."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    dtype: torch.dtype = torch.float32  # the parameter's dtype as the model built it (a fill draws at it)


@dataclass(frozen=True)
class FlatLayout:
    """The slots of a group's parameters, the flat vector's size and this rank's part of it (see [Note: flat
    layout])."""

    slots: tuple[ParamSlot, ...]
    numel: int
    shard_numel: int
    rank: int
    world: int

    @classmethod
    def of(cls, names: Sequence[str], values: Sequence[torch.Tensor], rank: int, world: int,
           align: int = 1) -> "FlatLayout":
        """``align`` > 1: every slot and the shard size start at a multiple of ``align`` elements (the blocks of a
        4-bit group, [Note: 4-bit shards] in zinf/param/four_bit.py)."""
        slots, offset = [], 0
        for n, v in zip(names, values):
            offset = -(-offset // align) * align
            slots.append(ParamSlot(name=n, shape=v.shape, offset=offset, numel=v.numel(), dtype=v.dtype))
            offset += v.numel()
        shard = max(1, math.ceil(offset / world))
        return cls(tuple(slots), offset, -(-shard // align) * align, rank, world)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def lo(self) -> int:
        """Where this rank's shard starts in the flat vector."""
        return self.rank * self.shard_numel

    def check_ranks(self, rank: int, world: int, name: str) -> None:
        """The group was laid out for these ranks (an engine gathers it through its own process group)."""
        if (rank, world) != (self.rank, self.world):
            raise ValueError(f"{name}: built as rank {self.rank} of {self.world}, handed rank {rank} of {world}; "
                             "build the model and the engine in the same process group")

    def local_range(self, index: int) -> tuple[int, int]:
        """The part of parameter ``index`` held by this rank, as [start, end) into the shard."""
        slot, lo = self.slots[index], self.lo
        a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + self.shard_numel)
        return (a - lo, b - lo) if a < b else (0, 0)

    def local_slices(self) -> Iterator[tuple[int, int, int, int]]:
        """(slot index, start, end in this rank's shard, the first of the parameter's flattened elements there) for
        every slot this rank's shard covers."""
        for i, slot in enumerate(self.slots):
            a, b = self.local_range(i)
            if a < b:
                yield i, a, b, a + self.lo - slot.offset

    def placeholders(self, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Each parameter's stand-in while released: one NaN element expanded (stride 0) to its shape (see [Note:
        releasing memory] in zinf/param/layout.py)."""
        nan = torch.full((1,), float("nan"), dtype=dtype, device=device)
        return [nan.as_strided(tuple(s.shape), (0,) * len(s.shape)) for s in self.slots]

    def slot_at(self, offset: int) -> ParamSlot | None:
        """The slot whose elements include flat position ``offset`` (None in the padding)."""
        return next((s for s in self.slots if s.offset <= offset < s.offset + s.numel), None)
