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

[Note: gradient landing]
A shard in host memory while compute runs on a device apart (``off_device``: an offloaded optimizer on CUDA, or the
staged setting, see [Note: staged device] in zinf/device_memory.py) receives each reduce-scattered slice by a copy
on the copy-out stream, issued once the reduce-scatter is done, into (pinned) host memory: the host does not wait.
When nothing accumulates (EMPTY) the slice is copied straight into the shard; a later micro-batch's slice lands in a
staging buffer of its own and is added on the host. The shard *lands* (its copies are waited for, the staged slices
added in order, and the statistics due at completion taken) the first time the host reads it: norms, finiteness,
the stash, the optimizer. The values are those of the add into zeros: 0 + x is x (a -0.0 becomes +0.0 there).
"""

from __future__ import annotations

import enum
import math
import threading
import weakref
from typing import Protocol, Sequence

import torch

from zinf.device_memory import host_empty, host_zeros, mark_device
from zinf.runtime.streams import BufferFence, Streams
from zinf.runtime.logs import region
from zinf.param.keys import GroupKey


__all__ = ["GradState", "GradShard", "GradStash"]


class GradState(enum.Enum):
    EMPTY = "empty"
    ACCUMULATING = "accumulating"
    RESIDENT = "resident"
    ON_NVME = "on_nvme"


class GradStash(Protocol):
    """Where complete gradient shards go when they do not stay in memory (NVMe)."""

    def write(self, group: GroupKey, shard: torch.Tensor) -> None: ...
    def read(self, group: GroupKey) -> torch.Tensor: ...


def _exact_factor(f: float) -> bool:
    """Whether multiplying by ``f`` only moves the exponent (a power of two), so it commutes with rounding."""
    if f == 0.0 or not math.isfinite(f):
        return False
    return math.frexp(abs(f))[0] == 0.5


class GradShard:
    def __init__(self, group: GroupKey, ranges: Sequence[tuple[int, int]], device: torch.device,
                 stash: GradStash | None = None, eager_stats: bool = False, check_finite: bool = False,
                 off_device: bool = False) -> None:
        # for the stash's records; the shard itself never reads the group. Weak, as MasterShard's (see there)
        self._group_ref = weakref.ref(group)
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
        # [Note: gradient landing]: host memory fed by copies off the compute device
        self.off_device = off_device
        self._landings: list[BufferFence] = []  # copies into the shard (or its staged slices) not waited for yet
        self._staged: list[torch.Tensor] = []  # later micro-batches' slices, added once landed
        self._stats_due = False  # completed while its copies were in flight: statistics taken when it lands
        self._landing_lock = threading.Lock()  # an early optimizer step may land it off the training thread
        self.version = 0  # counts additions: a step taken early (zinf/optim/early_steps.py) checks it is unchanged

    @property
    def _group(self) -> GroupKey:
        group = self._group_ref()
        assert group is not None, "a gradient shard outlived its group"
        return group

    # -- memory -------------------------------------------------------------------------------
    @property
    def resident(self) -> torch.Tensor | None:
        """The shard's memory when it has any (None before first use and while ON_NVME), landed."""
        self._land()
        return self._tensor

    def tensor(self) -> torch.Tensor:
        """The shard in memory with every pending factor applied (read back from NVMe if it is there)."""
        if self.state is GradState.ON_NVME:
            assert self.stash is not None
            self._tensor = self.stash.read(self._group)
            self.state = GradState.RESIDENT
        elif self._tensor is None:
            self._tensor = self._zeros()
        self.apply_pending()
        return self._tensor

    def _zeros(self) -> torch.Tensor:
        if self.off_device:  # pinned with CUDA: the copies off the device run without the host
            return host_zeros(self.numel, torch.float32, self._group.device)
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        if self.device == self._group.device:
            mark_device(out)  # on the compute device ([Note: staged device] in zinf/device_memory.py)
        return out

    def add_reduced(self, part: torch.Tensor, world: int, reduced: BufferFence, streams: Streams) -> BufferFence | None:
        """Add this rank's reduce-scattered slice (``part``: the sum over ranks, on the compute device; the
        reduce-scatter's fence ``reduced``) as its mean over ranks. Off the device, the copy is only issued (see
        [Note: gradient landing]) on ``streams.copy_out``; its fence is returned, holding the device tensors it reads until the compute
        stream has waited for it (the caller's ``make_wait`` and ``release``)."""
        if not self.off_device:
            self.accumulating().add_(part.to(self.device, torch.float32).div_(world))
            return None
        if self.state is GradState.ON_NVME:
            self.tensor()  # read back: the slice is added to it
        reduced.make_wait(streams.copy_out)
        with region("d2h", self._group.name), streams.use(streams.copy_out):
            mean = part.to(torch.float32).div_(world)
            if self.state is GradState.EMPTY:  # nothing accumulates: a copy into the shard
                if self._tensor is None:
                    self._tensor = self._zeros()
                self._tensor.copy_(mean, non_blocking=True)
            else:
                staged = host_empty(self.numel, torch.float32, part.device)
                staged.copy_(mean, non_blocking=True)
                self._staged.append(staged)
            fence = streams.record(streams.copy_out, part, mean)
        with self._landing_lock:
            self._landings.append(fence)
        self.state, self._norms, self._finite = GradState.ACCUMULATING, None, None
        self.version += 1
        return fence

    def _land(self) -> None:
        """Wait for the copies off the device and add the staged slices (see [Note: gradient landing])."""
        if not self._landings:
            return
        with self._landing_lock:
            for fence in self._landings:
                fence.wait()
            self._landings = []
            assert self._tensor is not None
            for staged in self._staged:
                self._tensor.add_(staged)
            self._staged = []
            if self._stats_due:
                self._stats_due = False
                self._take_stats()

    def accumulating(self) -> torch.Tensor:
        """The shard to add a backward's gradient into (its complete-time statistics no longer hold)."""
        t = self.tensor()
        self.state, self._norms, self._finite = GradState.ACCUMULATING, None, None
        self.version += 1
        return t

    def complete(self) -> None:
        """This backward's gradient is final: take its statistics and, with a stash, hand it there."""
        if self.state is not GradState.ACCUMULATING:
            return
        assert self._tensor is not None
        self.state = GradState.RESIDENT
        if self.eager_stats:
            if self._landings and self.stash is None:
                self._stats_due = True  # taken when the host first reads it (see [Note: gradient landing])
            else:
                self._land()
                self._take_stats()
        if self.stash is not None:
            self.stash.write(self._group, self._tensor)
            self._tensor = None
            self.state = GradState.ON_NVME

    def zero(self, memory_zeroed: bool = False) -> None:
        """After a step (or a skipped one): no gradient. Resident memory is zeroed (unless the consumer already
        did, ``memory_zeroed``: the fused Adam pass) and kept (a torch optimizer holds views of it)."""
        self._land()
        self._stats_due = False
        if self.state is GradState.ON_NVME and self.stash is not None:
            self.stash.forget(self._group)  # pool buffers still holding it ([Note: gradients held for the step])
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
        self._land()
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
        self._land()
        if self._finite is None:
            self._finite = bool(torch.isfinite(self.tensor()).all())
        return self._finite

    def apply_pending(self) -> None:
        """Multiply the resident shard by the pending factors, one float32 multiply each, in order."""
        self._land()
        if self.pending and self._tensor is not None:
            for f in self.pending:
                self._tensor.mul_(f)
            self.pending = []
            self.version += 1
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
