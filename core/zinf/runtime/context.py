"""The run context: what every part of one engine (or of one ``zinf.Init``) shares to move tensors and account for
them, built once and handed down.

The placement, the stores, the reducer, the rounds, the fetcher and the hooks receive it at construction; flat
groups, which ``zinf.Init`` builds before any engine exists, receive it in the verbs that gather them
(``start_gather(ctx)``). Nothing looks streams or process groups up by device.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def empty(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A gather buffer (``torch.empty``'s arguments): from the cache where there is one."""
        if self.buffers is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.buffers.empty(numel, dtype, device)

    def resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Resize a full buffer's storage on the device (through the cache where there is one)."""
        if self.buffers is None or self.device.type != "cpu":
            storage.resize_(nbytes)
        else:
            self.buffers.resize(storage, nbytes)

    @property
    def device(self) -> torch.device:
        return self.streams.device

    @classmethod
    def build(cls, comm: Comm, device: torch.device, timers: StepTimers | None = None,
              host: HostMemory | None = None) -> "RunContext":
        return cls(comm=comm, streams=Streams(device), timers=timers if timers is not None else StepTimers(),
                   host=host if host is not None else HostMemory())
