"""The flat gradient of one group while a backward assembles it: each parameter's full gradient placed at its slot,
until every parameter that trains has given one and the group can be reduce-scattered."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zinf.device_memory import mark_device
from zinf.param.grad_shard import GradShard
from zinf.param.layout import FlatLayout

__all__ = ["FlatGrad"]


class FlatGrad:
    """Which slots' gradients arrived since the last reduce, the flat buffer they were added into, and which slots
    produced a gradient since the last optimizer step."""

    def __init__(self, layout: FlatLayout, device: torch.device, params: Sequence[nn.Parameter | None]) -> None:
        self.layout = layout
        self.device = device
        self.refresh_requires_grad(params)
        self.full: torch.Tensor | None = None
        self.arrived: set[int] = set()  # slots whose gradient arrived since the last reduce
        # [Note: stepped parameters] which slots produced a gradient since the last optimizer step: on this
        # rank until the end of a backward, then (several ranks) on any rank; the optimizer steps only these
        self.used = torch.zeros(len(layout.slots), dtype=torch.bool)
        self.reported_ready = False  # this rank's gradients of the group were announced to the other ranks

    def refresh_requires_grad(self, params: Sequence[nn.Parameter | None]) -> None:
        """Take the parameters' ``requires_grad`` as it is now (frozen after construction, before the engine)."""
        self.requires_grad = [p is not None and p.requires_grad for p in params]
        self.num_trained = sum(self.requires_grad)

    def requires_grad_changed(self, params: Sequence[nn.Parameter | None]) -> str | None:
        """The name of a parameter whose ``requires_grad`` differs from what the engine was built with."""
        for p, slot, flag in zip(params, self.layout.slots, self.requires_grad):
            if p is not None and p.requires_grad != flag:
                return slot.name
        return None

    def add(self, index: int, grad: torch.Tensor, reduce_dtype: torch.dtype, shard: GradShard) -> bool:
        """Place slot ``index``'s full gradient; True once every slot that trains has given one.

        With one rank the gradient shard is the whole flat vector, so the gradient is accumulated into
        it directly (the same 0 + g, then + g2, as through a flat buffer) and nothing is left to reduce, unless the
        shard is in host memory off the device (``off_device``): then it is reduced (a copy) and copied off as with
        several ranks (see [Note: gradient landing] in zinf/param/grad_shard.py)."""
        slot = self.layout.slots[index]
        self.used[index] = True
        if self.layout.world == 1 and not shard.off_device:
            shard.accumulating()[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1).to(shard.device))
        else:
            if self.full is None and self._adoptable(slot.numel, grad, reduce_dtype):
                self.full = grad.reshape(-1)  # [Note: a lone gradient adopted]
                mark_device(self.full)
            else:
                if self.full is None:
                    self.full = torch.zeros(self.layout.padded_numel, dtype=reduce_dtype, device=self.device)
                    mark_device(self.full)
                self.full[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
        expected = self.num_trained
        complete_before = len(self.arrived) == expected
        self.arrived.add(index)
        # a parameter's gradient can arrive twice in one backward (a re-entrant checkpoint runs a backward of
        # its own): the group completes once, and what comes later is reduced again at the end of backward
        return not complete_before and len(self.arrived) == expected

    def _adoptable(self, numel: int, grad: torch.Tensor, reduce_dtype: torch.dtype) -> bool:
        """[Note: a lone gradient adopted]
        A group with one parameter that trains and no padding (an embedding, an output projection: the largest
        single gradients of a language model) would copy its only gradient into a flat buffer of the same size, both
        alive at once. Where autograd's gradient already is that buffer (the reduce dtype, contiguous, the whole of
        a storage of its own, no graph), it becomes the flat gradient itself: the hook sets ``param.grad`` to None
        right after, and autograd hands a parameter a gradient that nothing else references (it copies one that is
        referenced elsewhere), so no other tensor sees the reduce's writes or a second gradient added into it."""
        return (self.num_trained == 1 and numel == self.layout.padded_numel and grad.dtype == reduce_dtype
                and grad.device == self.device and not grad.requires_grad and grad.is_contiguous()
                and grad.storage_offset() == 0
                and grad.untyped_storage().nbytes() == numel * grad.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of the flat gradient being assembled (0 when none is)."""
        return 0 if self.full is None else self.full.numel() * self.full.element_size()

    @property
    def pending(self) -> bool:
        return bool(self.arrived)

    def take(self, reduce_dtype: torch.dtype, off_device: bool) -> torch.Tensor | None:
        """The flat gradient to reduce-scatter (None with one rank and the shard on the device: it is already in
        the shard). Zeros when this rank produced none this time but another rank did (its part of the sum is
        zero)."""
        full, self.full = self.full, None
        self.arrived = set()
        self.reported_ready = False
        if full is None and (self.layout.world > 1 or off_device):
            full = torch.zeros(self.layout.padded_numel, dtype=reduce_dtype, device=self.device)
        return full

    def report_ready(self) -> bool:
        """Mark this rank's gradients of the group as announced to the other ranks; False if they already were."""
        first, self.reported_ready = not self.reported_ready, True
        return first
