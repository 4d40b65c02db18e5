"""The stateless collectives the engine uses, with a no-communication path for one rank.

Every collective goes through here so that the CPU (gloo) and CUDA (NCCL) paths are one code path:
with ``async_op=True`` the returned work object is waited on where the result is needed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "Transport", "default_device", "compute_device"]

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# torch's coalescing manager (private, used by FSDP1 and torch's own tests); without it, one call per tensor
_coalescing_manager = getattr(dist.distributed_c10d, "_coalescing_manager", None) if dist.is_available() else None
_ALIGN_BYTES = 16  # the widest element (complex128): a slot at this boundary views as any dtype


class Transport(Protocol):
    """A way for the ranks of one host to move collectives' bytes other than the process group (the shared memory of
    zinf/runtime/same_host.py). Its collectives complete when called."""

    @property
    def is_open(self) -> bool: ...

    def all_gather(self, outs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> None: ...

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor) -> None: ...

    def share_pool(self, comm: "Comm", nbytes: int) -> Any: ...

    def take_counts(self) -> dict[str, int]: ...

    def bytes_by_tier(self) -> dict[str, dict[str, int]]: ...

    def close(self) -> None: ...


def host_boot() -> tuple[str, str]:
    """This host's name and the kernel's boot id: processes with both equal run on one kernel ("" where the boot id
    cannot be read)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def default_device() -> torch.device:
    """The compute device: CUDA when NCCL (or no process group) and a GPU are there, else CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    if torch.cuda.is_available():  # pragma: no cover - CUDA path, not run in CI
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_device(device: torch.device | str | None = None) -> torch.device:
    """The one spelling of a device inside zinf: ``cpu:0`` is ``cpu`` (front ends pass either: Accelerate
    ``cpu:0``, Lightning ``cpu``), ``cuda`` is the current CUDA device, None is :func:`default_device`. With one
    spelling, "is this tensor already on the group's device?" is a plain ``==`` everywhere."""
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda":
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(device.type)


@dataclass(frozen=True)
class Comm:
    """One data-parallel process group: who we are, how many we are, and the collectives."""

    rank: int
    world: int
    group: Any = None
    device: torch.device = torch.device("cpu")  # where small control tensors (flags, norms) live
    # a gloo group over the same ranks for host-side control messages, where ``group``'s backend takes device
    # tensors only (NCCL); None: ``group`` itself takes host tensors (see [Note: host-side agreement])
    host_group: Any = None
    # the ranks' shared memory where every rank runs on this host and computes on its CPU (see [Note: same-host
    # collectives] in zinf/runtime/same_host.py); None: every collective through ``group``
    same_host: Transport | None = None
    # how many of the ranks run on this host, counted at build where they share no memory (``with_same_host``)
    host_ranks: int | None = None

    @functools.cached_property
    def backend(self) -> str:
        """The process group's backend ("gloo", "nccl", ...); "" with one process and no group. Asked at every
        round (``ParamFetcher``), looked up once: a group's backend never changes."""
        if self.world == 1 or not (dist.is_available() and dist.is_initialized()):
            return ""
        return str(dist.get_backend(self.group))

    @classmethod
    def current(cls, group: Any = None, device: torch.device | None = None) -> "Comm":
        device = device or default_device()
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(group), world=dist.get_world_size(group), group=group, device=device)
        return cls(rank=0, world=1, group=None, device=device)

    def ranks_on_host(self) -> int:
        """How many of this group's ranks share this host's memory: all of them where they share memory
        (``same_host``), else as counted at build (``host_ranks``), else as many as the launcher started here
        (``LOCAL_WORLD_SIZE``), else this one."""
        if self.same_host is not None:
            return self.world
        if self.host_ranks is not None:
            return self.host_ranks
        return max(1, min(self.world, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))

    def with_host_group(self) -> "Comm":
        """[Note: host-side agreement] What the ranks tell each other inside a pass (the rounds of
        zinf/schedule/rounds.py, which parameters got gradients) are a few host integers. Sent over NCCL they would be
        copied to the device and read back, and each read waits for every kernel queued before it: the CPU could never
        run ahead of the GPU. They go over a gloo group of the same ranks instead, in host memory, so that nothing
        between the first forward operation and the end of the backward waits for the device. With gloo (or a group
        whose backends include gloo) the group itself takes host tensors and no second group is made. Every rank of
        the default group must call this together (it creates a group)."""
        if self.world == 1 or self.host_group is not None or "gloo" in self.backend:
            return self
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        return dataclasses.replace(self, host_group=dist.new_group(ranks=ranks, backend="gloo"))

    def with_same_host(self, transport: Transport | None) -> "Comm":
        """This group with its ranks' shared memory (``SameHostTransport.connect``, which every rank calls
        together); without it, with the count of its ranks on this host (``ranks_on_host``: the host memory each
        may take), which every rank asks together."""
        if transport is not None:
            return dataclasses.replace(self, same_host=transport)
        if self.world == 1:
            return self
        here = host_boot()
        return dataclasses.replace(self, host_ranks=sum(h == here for h in self.all_gather_object(here)))

    def _shared(self, tensor: torch.Tensor) -> Transport | None:
        """The shared-memory transport for a collective of ``tensor``, if it takes one: open, and a CPU tensor.
        Whether it applies is the same on every rank (every rank closes the transport at the same point)."""
        t = self.same_host
        return t if t is not None and t.is_open and tensor.device.type == "cpu" else None

    def gathers_widening(self, out: torch.Tensor) -> bool:
        """Whether an all-gather into ``out`` may take shards of a narrower dtype and widen them as it copies (through
        shared memory: [Note: a widening gather] in zinf/runtime/same_host.py); the same on every rank."""
        return self.world > 1 and self._shared(out) is not None

    def close(self) -> None:
        """Unmap the shared memory; the collectives go through the process group from then on."""
        if self.same_host is not None:
            self.same_host.close()

    def host_all_gather_into(self, out: torch.Tensor, message: torch.Tensor, async_op: bool) -> Any:
        """:meth:`all_gather_into` for host tensors (see [Note: host-side agreement])."""
        if self.world == 1:
            out.copy_(message)
            return None
        return _all_gather_single(out, message, group=self.host_group or self.group, async_op=async_op)

    def host_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """:meth:`all_reduce` for a host tensor (see [Note: host-side agreement])."""
        if self.world > 1:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            dist.all_reduce(tensor, op=red, group=self.host_group or self.group)
        return tensor

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Any:
        """``out`` (world * shard.numel()) receives every rank's shard, rank-major."""
        if self.world == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return None
        shared = self._shared(out)
        if shared is not None:
            shared.all_gather([out], [shard])
            return None
        return _all_gather_single(out, shard, group=self.group, async_op=async_op)

    def all_gather_coalesced(self, outs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> Any:
        """Every ``outs[i]`` receives every rank's ``shards[i]``, rank-major, as one collective per dtype (every
        rank passes the same sizes and dtypes in the same order); returns the handle to wait on (asynchronous).
        One per dtype: gloo's coalesced all-gather reads every tensor as the first one's dtype (measured with
        torch 2.13: bf16 then fp32 comes back wrong). With gloo and device tensors, one call per tensor: gloo's
        coalesced all-gather of CUDA tensors kills the process (SIGSEGV, measured with torch 2.11 on an H200),
        where its single all-gather of them works. See [Note: one collective per round] in
        zinf/runtime/collectives.py."""
        if (self.world == 1 or len(outs) <= 1 or _coalescing_manager is None
                or ("gloo" in self.backend and outs[0].device.type != "cpu")):
            works = [self.all_gather_into(o, s, async_op=True) for o, s in zip(outs, shards)]
            return _Works([w for w in works if w is not None])
        shared = self._shared(outs[0])
        if shared is not None:  # every dtype in one pass: the bytes are copied as they are
            shared.all_gather(outs, shards)
            return _Works([])
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for out, shard in zip(outs, shards):
            by_dtype.setdefault(shard.dtype, []).append((out, shard))
        works = []
        for pairs in by_dtype.values():  # in order of first appearance: the same on every rank
            with _coalescing_manager(group=self.group, async_ops=True) as manager:
                for out, shard in pairs:
                    _all_gather_single(out, shard, group=self.group, async_op=True)
            works.append(manager)
        return works[0] if len(works) == 1 else _Works(works)

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, async_op: bool) -> Any:
        """``out`` receives this rank's slice of the element-wise sum of every rank's ``full``."""
        if self.world == 1:
            out.copy_(full)
            return None
        shared = self._shared(full)
        if shared is not None:
            shared.reduce_scatter_sum(out, full)
            return None
        return _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            dist.all_reduce(tensor, op=red, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small and picklable: a flag, a message, a record), indexed by rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.world > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return tensor

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Every tensor takes rank ``src``'s values, in one broadcast whatever their dtypes and devices: their
        bytes are packed into one flat buffer on ``self.device`` (each at a ``_ALIGN_BYTES`` boundary, so a slot
        reads back as its dtype), sent, and copied back into the tensors on the other ranks. A broadcast moves
        bytes, so the values arrive bit for bit. ``src`` is a rank of this group."""
        if self.world == 1 or not tensors:
            return
        nbytes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = [], 0
        for n in nbytes:
            offsets.append(total)
            total += -(-n // _ALIGN_BYTES) * _ALIGN_BYTES
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        if self.rank == src:
            for t, offset, n in zip(tensors, offsets, nbytes):
                flat[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        self.broadcast(flat, src)
        if self.rank != src:
            for t, offset, n in zip(tensors, offsets, nbytes):
                t.copy_(flat[offset : offset + n].view(t.dtype).view(t.shape))


class _Works:
    """Several collectives' handles waited for as one."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
