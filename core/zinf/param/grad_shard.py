"""A group's fp32 gradient shard: one object, one state, the same questions answered on every tier.

[Note: gradient shard states]
EMPTY: no gradient since the last step (memory, if any, holds zeros).
ACCUMULATING: in memory; a backward adds to it (reduce-scatter output, or a one-rank gradient in place).
RESIDENT: this backward's gradient is complete and in memory.
ON_NVME: complete and written to its stash (zinf/offload/grad_stash.py); its memory is freed.

Clipping and fp16 loss scaling ask every shard the same things, whatever its tier: its per-parameter norms,
whether it is finite, and to be scaled. The norms (and, for fp16, finiteness) are taken when the gradient is
complete, while it is in memory anyway (``eager_stats``; always before it leaves for NVMe), so the optimizer
step reads each gradient byte once. A scale is not applied at once: it is kept as a pending factor, and a
fused consumer (the offloaded CPU-Adam) applies it inside its own pass (``take_factor``); a torch optimizer
reads the shard after ``apply_pending``. Norms stay exact under pending power-of-two factors (fp16 unscaling):
scaling by 2**k commutes with rounding, so norms * 2**k equal the norms of the scaled shard bit for bit; any
other pending factor (a clip coefficient) makes the norms be taken again from the scaled values.
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["GradState", "GradShard", "GradStash"]


class GradState(enum.Enum):
    EMPTY = "empty"
    ACCUMULATING = "accumulating"
    RESIDENT = "resident"
    ON_NVME = "on_nvme"


class GradStash(Protocol):
    """Where complete gradient shards go when they do not stay in memory (NVMe)."""

    def write(self, group: "FlatParamGroup", shard: torch.Tensor) -> None: ...
    def read(self, group: "FlatParamGroup") -> torch.Tensor: ...


def _exact_factor(f: float) -> bool:
    """Whether multiplying by ``f`` only moves the exponent (a power of two), so it commutes with rounding."""
    if f == 0.0 or not math.isfinite(f):
        return False
    return math.frexp(abs(f))[0] == 0.5


class GradShard:
    def __init__(self, group: "FlatParamGroup", ranges: Sequence[tuple[int, int]], device: torch.device,
                 stash: GradStash | None = None, eager_stats: bool = False, check_finite: bool = False) -> None:
        self._group = group  # for the stash's records; the shard itself never reads the group
        self.numel = group.shard_numel
        self.ranges = list(ranges)  # per parameter slot: [start, end) of this rank's part, in shard coordinates
        self.device = device
        self.stash = stash
        self.eager_stats = eager_stats or stash is not None
        self.check_finite = check_finite
        self.state = GradState.EMPTY
        self._tensor: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None  # per-slot norms of the values as they were complete
        self._finite: bool | None = None
        self.pending: list[float] = []  # factors asked for and not yet applied, in order

    # -- memory -------------------------------------------------------------------------------
    @property
    def resident(self) -> torch.Tensor | None:
        """The shard's memory when it has any (None before first use and while ON_NVME)."""
        return self._tensor

    def tensor(self) -> torch.Tensor:
        """The shard in memory with every pending factor applied (read back from NVMe if it is there)."""
        if self.state is GradState.ON_NVME:
            assert self.stash is not None
            self._tensor = self.stash.read(self._group)
            self.state = GradState.RESIDENT
        elif self._tensor is None:
            self._tensor = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.apply_pending()
        return self._tensor

    def accumulating(self) -> torch.Tensor:
        """The shard to add a backward's gradient into (its complete-time statistics no longer hold)."""
        t = self.tensor()
        self.state, self._norms, self._finite = GradState.ACCUMULATING, None, None
        return t

    def complete(self) -> None:
        """This backward's gradient is final: take its statistics and, with a stash, hand it there."""
        if self.state is not GradState.ACCUMULATING:
            return
        assert self._tensor is not None
        self.state = GradState.RESIDENT
        if self.eager_stats:
            self._take_stats()
        if self.stash is not None:
            self.stash.write(self._group, self._tensor)
            self._tensor = None
            self.state = GradState.ON_NVME

    def zero(self, memory_zeroed: bool = False) -> None:
        """After a step (or a skipped one): no gradient. Resident memory is zeroed (unless the consumer already
        did, ``memory_zeroed``: the fused Adam pass) and kept (a torch optimizer holds views of it)."""
        if self._tensor is not None and self.state is not GradState.EMPTY and not memory_zeroed:
            self._tensor.zero_()
        self.state, self._norms, self._finite, self.pending = GradState.EMPTY, None, None, []

    # -- what clipping and loss scaling ask ----------------------------------------------------
    def scale(self, factor: torch.Tensor | float) -> None:
        if self.state is not GradState.EMPTY:
            self.pending.append(float(factor))

    def norms(self) -> torch.Tensor:
        """Per-slot 2-norms of the gradient as scaled so far (zeros when there is none)."""
        if self.state is GradState.EMPTY:
            return torch.zeros(len(self.ranges), device=self.device)
        if self._norms is not None and all(_exact_factor(f) for f in self.pending):
            norms = self._norms
            for f in self.pending:
                norms = norms * f
            return norms
        self.tensor()  # applies the pending factors
        self._take_stats()
        assert self._norms is not None
        return self._norms

    def finite(self) -> bool:
        if self.state is GradState.EMPTY:
            return True
        if self._finite is None:
            self._finite = bool(torch.isfinite(self.tensor()).all())
        return self._finite

    def apply_pending(self) -> None:
        """Multiply the resident shard by the pending factors, one float32 multiply each, in order."""
        if self.pending and self._tensor is not None:
            for f in self.pending:
                self._tensor.mul_(f)
            self.pending = []
            if self._norms is not None:
                self._norms, self._finite = None, None

    def take_factor(self) -> float:
        """The pending factors as one multiplier for a fused consumer, exactly equal to applying them one by
        one (at most one of them is not a power of two; otherwise they are applied here first). Clears them."""
        inexact = [f for f in self.pending if not _exact_factor(f)]
        if len(inexact) > 1:
            self.tensor()  # applies them one by one
            return 1.0
        factor = math.prod(self.pending)  # powers of two move the exponent only: exact, in any order
        self.pending = []
        return factor

    def _take_stats(self) -> None:
        assert self._tensor is not None
        t = self._tensor
        self._norms = torch.stack([torch.linalg.vector_norm(t[a:b]) for a, b in self.ranges]) if self.ranges else \
            torch.zeros(0, device=self.device)
        self._finite = bool(torch.isfinite(t).all()) if self.check_finite else None

    def nbytes_on_nvme(self) -> int:
        return self.numel * 4 if self.state is GradState.ON_NVME else 0
