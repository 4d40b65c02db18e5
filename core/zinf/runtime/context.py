"""The run context: what every part of one engine (or of one ``zinf.Init``) shares to move tensors and account for
them, built once and handed down.

The placement, the stores, the reducer, the rounds, the fetcher and the hooks receive it at construction; flat
groups, which ``zinf.Init`` builds before any engine exists, receive it in the verbs that gather them
(``start_gather(ctx)``). Nothing looks streams or process groups up by device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zinf.host_memory import HostMemory
from zinf.native.buffer_cache import BufferCache
from zinf.report import StepTimers
from zinf.runtime.comm import Comm
from zinf.runtime.streams import Streams

__all__ = ["RunContext"]


@dataclass(frozen=True)
class RunContext:
    """The process group (with its host-side group and same-host transport), the four side streams of the compute
    device, the step timers, the host-memory account of one engine and, on the CPU, the cache its gather buffers'
    memory comes from (None: fresh memory each gather; [Note: gather buffer cache] in zinf/native/buffer_cache.py)."""

    comm: Comm
    streams: Streams
    timers: StepTimers
    host: HostMemory
    buffers: BufferCache | None = None

    def gather_cache(self, trainable: bool) -> BufferCache | None:
        """The cache a group's gather buffers come from: None without one, and for a group that trains where the
        engine trims the host heap (CPU compute, parameters offloaded: a full fine-tune there is short of host memory,
        and the cache keeps up to 1.25 times the gathers' high-water mark). A frozen base's gathers (LoRA, QLoRA) are
        most of such a step: they always use it. [Note: gather buffer cache] in zinf/native/buffer_cache.py."""
        if self.buffers is None or (trainable and self.host.heap.every_bytes):  # built for CPU compute only
            return None
        return self.buffers

    def empty_for(self, trainable: bool) -> Callable[..., torch.Tensor]:
        """``torch.empty`` for a group's gather buffers: from its cache where it has one (``gather_cache``)."""
        cache = self.gather_cache(trainable)
        return torch.empty if cache is None else cache.empty

    def resize(self, storage: torch.UntypedStorage, nbytes: int, trainable: bool) -> None:
        """Resize a group's full buffer's storage: through its cache where it has one (``gather_cache``)."""
        cache = self.gather_cache(trainable)
        if cache is None:
            storage.resize_(nbytes)
        else:
            cache.resize(storage, nbytes)

    @property
    def device(self) -> torch.device:
        return self.streams.device

    @classmethod
    def build(cls, comm: Comm, device: torch.device, timers: StepTimers | None = None,
              host: HostMemory | None = None) -> "RunContext":
        return cls(comm=comm, streams=Streams(device), timers=timers if timers is not None else StepTimers(),
                   host=host if host is not None else HostMemory())
