"""Side streams, the events that gate reuse, and the names that profiler traces and debug logs share.

[Note: streams]
One :class:`Streams` per engine (built with its run context, ``zinf/runtime/context.py``, and handed to the
stores, the reducer and the gathers) holds four side streams (the layout of torch FSDP2's
``FSDPCommContext``). The compute stream is not one of them: it is whatever stream torch has
current when the engine runs (:meth:`Streams.current`), so a user's own stream context is respected.

- ``copy_in``: host -> device copies of offloaded shards (pinned pool buffer -> device shard).
  High priority, so a copy that compute is about to wait for is not queued behind other work.
- ``all_gather``: the coalesced all-gather of a module's device shards into its full parameter.
  High priority; a separate stream lets the next module's gather overlap this module's compute.
- ``reduce_scatter``: the post-backward reduce-scatter of full gradients into this rank's shard.
  High priority, so backward's communication is not delayed behind its own compute.
- ``copy_out``: device -> host copies of gradient shards (to the CPU/NVMe tier). Normal priority:
  it only feeds the optimizer step, so it must not delay the copy-ins compute is waiting on. It
  is apart from ``copy_in`` because H2D and D2H use separate copy engines and can run at once.

Every hand-over between two streams, or between a stream and the host, goes through a
:class:`BufferFence` (one CUDA event):

- a pinned pool buffer read by an H2D copy goes back to the pool only after ``fence.wait()``
  (the host blocks until the copy has read it; a pool that keeps its buffers allocated is not
  protected by torch's host allocator, which only guards its own free-and-reallocate);
- the all-gather waits for the H2D copy: ``h2d_fence.make_wait(streams.all_gather)``;
- compute waits for the all-gather before reading the gathered parameter:
  ``gather_fence.make_wait(streams.current())`` (the host does not block). NCCL runs a collective
  on its own internal stream: with ``async_op=True``, call ``work.wait()`` (a stream wait, the host
  goes on) inside a ``use(streams.all_gather)`` block, before ``record``, so the fence covers it.
  :class:`InFlight` does that when the result is needed, not when the collective is issued: with
  gloo ``work.wait()`` blocks the host, and the CPU path must go on while the gather runs;
- a gradient shard's D2H copy lands in a pinned buffer that the optimizer (host) reads only after
  ``d2h_fence.wait()``; the reduce-scatter's input gradient is dropped only after compute waited on
  the reduce-scatter's fence.

Memory of a tensor used on a stream other than the one it was allocated on: we do not call
``Tensor.record_stream``. record_stream makes the caching allocator record an event on the other
stream when the tensor is freed and reuse the block only once a later allocation finds that event
done: the block stays reserved for an unknown time, so peak memory depends on timing and grows when
the CPU runs ahead (FSDP1 needed a rate limiter for this; FSDP2 removed record_stream). Instead, the
same two rules as FSDP2:

1. Allocate on the stream that frees. Buffers a side stream writes for compute (device shard,
   gathered parameter) are allocated on the compute stream before entering the side stream, and
   the side stream first waits for compute (``side.wait_stream(streams.current())``), since the new
   block may be memory compute has just freed. Compute reads them only after ``make_wait``, so
   when compute later drops them, any reuse of the block is ordered after the side stream's work.
2. Keep alive until waited for. A tensor allocated on compute and read by a side stream (the
   full gradient read by the reduce-scatter, a device shard read by the all-gather) is passed to
   :meth:`BufferFence.record` as ``alive``; the fence holds it until ``wait()``, ``release()`` or the
   fence's own end, which the owner arranges to come after compute's ``make_wait``. Freeing is
   then deterministic (a Python reference drops) and costs no allocator bookkeeping.

On CPU there is no asynchrony to order: every op has finished when it returns. The streams are
:class:`NullStream` stand-ins and the events :class:`NullEvent`, whose methods do nothing, so the
engine's code is the same on both devices with no branch on the device; fences on CPU hold no
tensors. A fence still checks it was recorded before it is waited for, so CPU tests catch a
reuse that would race on CUDA.

The names that profiler traces and debug logs give this work (``zinf::all_gather(layers.3)``) are made in
zinf/runtime/logs.py (``label``, ``region``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Union

import torch

__all__ = [
    "BufferFence",
    "InFlight",
    "NullEvent",
    "NullStream",
    "SharedWork",
    "Streams",
]


# FSDP2's choice: high priority (-1) for the copy-in, all-gather and reduce-scatter streams, so their
# short copies are not delayed behind compute kernels; 0 (the default, lowest) for the rest.
_HIGH_PRIORITY = -1
_NORMAL_PRIORITY = 0


class NullEvent:
    """A CPU stand-in for ``torch.cuda.Event``: always complete (see [Note: streams])."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NULL_EVENT = NullEvent()


class NullStream:
    """A CPU stand-in for ``torch.cuda.Stream``: work issued "on" it has finished when issued."""

    __slots__ = ("name",)
    priority = _NORMAL_PRIORITY

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return _NULL_EVENT if event is None else event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"NullStream({self.name})"


Stream = Union[torch.cuda.Stream, NullStream]
Event = Union[torch.cuda.Event, NullEvent]


class BufferFence:
    """One event that gates a reuse: record it after the last op that reads (or writes) a buffer,
    then either block the host (:meth:`wait`) or make a stream wait (:meth:`make_wait`) before the
    buffer is reused or read. See [Note: streams] for which fence gates what.

    ``alive`` tensors given to :meth:`record` stay referenced until :meth:`wait`, :meth:`release` or the
    fence's end (rule 2 of the note); with a :class:`NullEvent` (CPU) nothing is held.
    """

    __slots__ = ("_event", "_holds", "_held", "_recorded")

    def __init__(self, event: Event | None = None) -> None:
        self._event: Event = _NULL_EVENT if event is None else event
        self._holds = not isinstance(self._event, NullEvent)
        self._held: list[torch.Tensor] = []
        self._recorded = False

    def record(self, stream: Stream, *alive: torch.Tensor) -> "BufferFence":
        """Mark the point reached by the work issued so far on ``stream``; hold ``alive`` until waited for."""
        self._event.record(stream)
        if self._holds:
            self._held.extend(alive)
        self._recorded = True
        return self

    def wait(self) -> None:
        """Block the host until the recorded work has finished (then held tensors are dropped)."""
        assert self._recorded, "zinf: BufferFence.wait() before record(): its buffer would be reused unguarded"
        self._event.synchronize()
        self._held.clear()

    def make_wait(self, stream: Stream) -> None:
        """Make ``stream`` wait, on the device, for the recorded work; the host goes on at once."""
        assert self._recorded, "zinf: BufferFence.make_wait() before record(): the stream would read unguarded"
        stream.wait_event(self._event)

    def query(self) -> bool:
        """Whether the recorded work has finished (never blocks); always True on CPU."""
        return self._event.query()

    def release(self) -> None:
        """Drop the held tensors: call once the allocating stream has waited (``make_wait``) for this fence."""
        self._held.clear()

    @property
    def num_held(self) -> int:
        return len(self._held)


class Streams:
    """The engine's four side streams on ``device``: real CUDA streams, or no-op stand-ins on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # chosen once: torch's stream context manager, or a no-op
        self._use: Callable[[Any], ContextManager[Any]] = torch.cuda.stream if self.is_cuda else _null_use
        self.copy_in: Stream = self._make("copy_in", _HIGH_PRIORITY)
        self.all_gather: Stream = self._make("all_gather", _HIGH_PRIORITY)
        self.reduce_scatter: Stream = self._make("reduce_scatter", _HIGH_PRIORITY)
        self.copy_out: Stream = self._make("copy_out", _NORMAL_PRIORITY)
        self._cpu_current = NullStream("compute")

    def _make(self, name: str, priority: int) -> Stream:
        if self.is_cuda:  # pragma: no cover - CUDA path, not run in CI
            return torch.cuda.Stream(device=self.device, priority=priority)
        return NullStream(name)

    def current(self) -> Stream:
        """The compute stream: torch's current stream on this device (a stand-in on CPU)."""
        if self.is_cuda:  # pragma: no cover - CUDA path
            return torch.cuda.current_stream(self.device)
        return self._cpu_current

    def use(self, stream: Stream) -> ContextManager[Any]:
        """``with streams.use(streams.copy_in):`` issues the block's work on that stream (no-op on CPU)."""
        return self._use(stream)

    def fence(self) -> BufferFence:
        """A new, unrecorded fence for this device."""
        return BufferFence(torch.cuda.Event() if self.is_cuda else None)

    def record(self, stream: Stream, *alive: torch.Tensor) -> BufferFence:
        """A new fence recorded on ``stream`` now, holding ``alive`` (see :meth:`BufferFence.record`)."""
        return self.fence().record(stream, *alive)

    def issue(self, stream: Stream, launch: Callable[[], Any], alive: tuple[torch.Tensor, ...] = ()) -> "InFlight":
        """Run ``launch`` (it issues a collective or a copy and returns its handle, or None) on ``stream`` once that
        stream has waited for compute (rule 1: what it reads or writes was allocated there); the returned
        :class:`InFlight` holds ``alive`` until compute joins it (rule 2)."""
        stream.wait_stream(self.current())
        with self.use(stream):
            work = launch()
        return InFlight(self, stream, work, alive)

    def named(self) -> dict[str, Stream]:
        return {"copy_in": self.copy_in, "all_gather": self.all_gather,
                "reduce_scatter": self.reduce_scatter, "copy_out": self.copy_out}

    def __repr__(self) -> str:
        return f"Streams(device={self.device})"


def _null_use(stream: Any) -> ContextManager[None]:
    return contextlib.nullcontext()


class SharedWork:
    """A handle several :class:`InFlight` share (one collective for several groups): the first join makes compute
    wait for it and keeps the fence; compute runs in order, so the later joins have nothing left to wait for."""

    __slots__ = ("joined",)

    def __init__(self) -> None:
        self.joined: BufferFence | None = None

    def mark_joined(self, fence: BufferFence) -> None:
        """Compute has waited for the shared work (``fence``, recorded after it): later joins return at once."""
        assert self.joined is None, "zinf: shared work is joined once"
        self.joined = fence

    def wait(self) -> None:  # pragma: no cover - subclasses wait for their collective
        raise NotImplementedError


class InFlight:
    """Work issued on a side stream (a collective, or a copy) until the compute stream has waited for it.

    ``work`` is the collective's handle, or None when nothing is left to wait for on the host's side (one
    rank, a synchronous call). ``alive`` are the tensors the side stream reads or writes that compute
    allocated (the source shard, the output buffer): held until :meth:`join` (rule 2 of [Note: streams]).
    :meth:`join` calls ``work.wait()`` on the side stream (with NCCL a stream wait; with gloo the host waits,
    as it always did on CPU), records a fence there, makes compute wait for it and then drops ``alive``.
    """

    __slots__ = ("streams", "stream", "shared", "_work", "_alive")

    def __init__(self, streams: Streams, stream: Stream, work: Any, alive: tuple[torch.Tensor, ...] = ()) -> None:
        self.streams = streams
        self.stream = stream
        self.shared = work if isinstance(work, SharedWork) else None  # joined once for every InFlight on it
        self._work = work
        self._alive = alive

    def join(self) -> BufferFence:
        """Compute waits for the work (the host only where the backend blocks); returns the recorded fence,
        which other streams may still wait for (``make_wait``)."""
        shared = self._work if isinstance(self._work, SharedWork) else None
        if shared is not None and shared.joined is not None:  # compute waited for the shared collective already
            self._work, self._alive = None, ()
            return shared.joined
        with self.streams.use(self.stream):
            if self._work is not None:
                self._work.wait()
            fence = self.streams.record(self.stream, *self._alive)
        self._work, self._alive = None, ()
        fence.make_wait(self.streams.current())
        fence.release()  # compute now comes after the side stream's work: its blocks may be reused
        if shared is not None:
            shared.mark_joined(fence)
        return fence
