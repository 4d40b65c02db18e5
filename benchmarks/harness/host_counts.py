"""Counting the host work of a training step on the CPU, as a GPU run would pay it.

:class:`HostWork` is a context manager around one step. Inside it:

- every aten operation and every c10d collective is counted (a dispatch mode: what the backend receives, so a
  coalesced collective counts once); zinf's control messages (``Comm.host_all_gather_into``/``host_all_reduce``,
  which a GPU run sends over a gloo group beside NCCL) are counted apart;
- stream and event calls are counted (``torch.cpu.Stream``/``Event``/``stream``/``current_stream``, FSDP2's device
  handle on the CPU, and zinf's ``Streams``, ``NullStream`` and ``NullEvent``);
- the placement of every tensor is replayed as if the compute device were a GPU, and each operation that would
  make the host wait for the device is counted as a *blocking sync* (a torch function mode).

[Note: device replay]
On a GPU, host and device memory are apart; on the CPU both are the same, so where a tensor would live is
replayed from how it was made. A tensor lives on the device when it is a model parameter or buffer, an input the
caller marks (:meth:`HostWork.on_device`), the result of a factory called with an explicit ``device=`` (the
compute device: host code leaves ``device`` out), of ``Tensor.to(<device>)``/``torch.empty_like`` and
friends of a device tensor, or of any operation with a device tensor among its arguments. ``Tensor.cpu()``,
``Tensor.numpy()`` and ``pin_memory()`` give host tensors. (An in-place ``copy_`` into a device tensor from the host
is not counted: whether its source was pageable cannot be told from the CPU run.) To keep host and device copies apart where the CPU
would hand back the same object (``t.cpu()`` of a CPU tensor is ``t``), those moves return a fresh copy in the
replay. Blocking syncs counted: a host read of a device value (``item``, ``tolist``, ``bool``/``int``/``float``,
``cpu``, ``numpy``), a copy from the device into host memory without ``non_blocking=True``, a move to the device of
a host tensor without ``non_blocking=True`` (``.to(device)``: from pageable memory, synchronous),
an operation whose output size depends on a device value (``nonzero``, ``masked_select``, ``unique``...), and
``synchronize()`` on a stream or event. What it cannot see: work in C++ that reads device values (none in torch's
training path) and a copy that really is asynchronous but was marked otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Counts", "HostWork"]

_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__"}
_DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                   "nonzero_static"}
_FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "empty_strided",
              "as_tensor", "linspace", "eye"}


@dataclass
class Counts:
    """What one step issued. ``syncs`` maps a call site kind to its count."""

    aten_ops: int = 0
    collectives: collections.Counter = field(default_factory=collections.Counter)
    stream_calls: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)

    host_messages: int = 0  # zinf's control messages (Comm.host_*), among the collectives

    @property
    def num_collectives(self) -> int:
        """Collectives that carry device tensors (with NCCL: NCCL's)."""
        return sum(self.collectives.values()) - self.host_messages

    @property
    def num_host_collectives(self) -> int:
        """Collectives of host tensors only (with NCCL: on a gloo group beside it)."""
        return self.host_messages

    @property
    def num_stream_calls(self) -> int:
        return sum(self.stream_calls.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    def as_dict(self) -> dict[str, Any]:
        return {"aten_ops": self.aten_ops, "collectives": dict(self.collectives), "stream_calls":
                self.num_stream_calls, "stream_calls_by_kind": dict(self.stream_calls), "syncs": dict(self.syncs),
                "num_collectives": self.num_collectives,
                "num_host_collectives": self.num_host_collectives, "num_syncs": self.num_syncs}


class _Dispatch(TorchDispatchMode):
    """Counts aten operations and collectives (as the backend receives them: a coalesced collective once)."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if func.namespace == "c10d":
            self.counts.collectives[name.rstrip("_")] += 1
        else:
            self.counts.aten_ops += 1
        return func(*args, **(kwargs or {}))


class _Replay(TorchFunctionMode):
    """The device placement replay of [Note: device replay]."""

    def __init__(self, counts: Counts, device: dict[int, weakref.ref] | None = None) -> None:
        super().__init__()
        self.counts = counts
        # id -> the tensor (a weak set would compare tensors with ==); shared by the replays of one HostWork
        self.device: dict[int, weakref.ref] = {} if device is None else device

    def mark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self.device[id(t)] = weakref.ref(t)

    def _is_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self.device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" or name == "__set__":  # attribute access (t.grad, t.data = ...)
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        any_device = any(self._is_device(a) for a in flat)
        this = args[0] if args else None
        if name in _HOST_READS and self._is_device(this):
            self.counts.syncs[f"host read ({name})"] += 1
        elif name in _DATA_DEPENDENT and any_device:
            self.counts.syncs[f"data-dependent size ({name})"] += 1
        elif name == "cpu" and self._is_device(this):
            self.counts.syncs["device -> host copy (cpu)"] += 1
        elif name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if self._is_device(src) and not self._is_device(dst) and not non_blocking:
                self.counts.syncs["device -> host copy (copy_)"] += 1
        out = func(*args, **kwargs)
        if name in ("cpu", "numpy", "pin_memory"):
            return _fresh(out, this)
        if name == "to" and self._to_device(args, kwargs):
            if not self._is_device(this) and isinstance(this, torch.Tensor):
                if not kwargs.get("non_blocking", False):
                    self.counts.syncs["pageable host -> device copy (to)"] += 1
                out = _fresh(out, this)
            self.mark(out)
            return out
        if name in _FACTORIES and kwargs.get("device") is not None:
            self.mark(out)
        elif any_device and name != "copy_":
            inputs = {id(a) for a in flat if isinstance(a, torch.Tensor)}
            for o in tree_flatten(out)[0]:
                if id(o) not in inputs:  # an in-place result keeps its own placement
                    self.mark(o)
        return out

    @staticmethod
    def _to_device(args: tuple, kwargs: dict) -> bool:
        """Whether ``Tensor.to(...)`` names a device (the compute device, see [Note: device replay])."""
        if "device" in kwargs:
            return True
        return any(isinstance(a, (torch.device, str)) for a in args[1:2])


def _fresh(out: Any, source: Any) -> Any:
    """A copy where the CPU handed back the same object (so that host and device copies stay apart)."""
    if isinstance(out, torch.Tensor) and out is source:
        return out.detach().clone() if not out.requires_grad else out.clone()
    return out


class _StreamCounter:
    """Wraps the methods of stream and event classes (and zinf's host messages) to count their calls."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, attr: str, kind: str) -> None:
        original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if original is None or isinstance(original, (property, type)):
            return
        counts = self.counts
        blocking = attr == "synchronize"
        is_static = isinstance(original, staticmethod)
        target = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts.stream_calls[f"{kind}.{attr}"] += 1
            if blocking:
                counts.syncs[f"{kind}.synchronize"] += 1
            return target(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, staticmethod(counted) if is_static else counted)

    def _wrap_host_message(self, owner: type, attr: str) -> None:
        original = owner.__dict__[attr]
        counts = self.counts

        def counted(comm: Any, *args: Any, **kwargs: Any) -> Any:
            if comm.world > 1:
                counts.host_messages += 1
            return original(comm, *args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def install(self) -> None:
        import torch.cpu as cpu

        for attr in ("current_stream", "stream", "synchronize"):
            self._wrap(cpu, attr, "torch.cpu")
        for cls, kind in ((cpu.Stream, "torch.cpu.Stream"), (getattr(cpu, "Event", None), "torch.cpu.Event")):
            if cls is None:
                continue
            for attr in ("wait_stream", "wait_event", "record_event", "synchronize", "query", "record", "wait",
                         "__enter__", "__exit__"):
                if attr in cls.__dict__:
                    self._wrap(cls, attr, kind)
        with contextlib.suppress(ImportError):
            from zinf.runtime.comm import Comm

            for attr in ("host_all_gather_into", "host_all_reduce"):
                self._wrap_host_message(Comm, attr)
        with contextlib.suppress(ImportError):
            from zinf.runtime import streams as zs

            # the calls that reach the CUDA API on a GPU (zinf's wrappers around them are not counted again)
            wrapped = {zs.NullStream: ("wait_stream", "wait_event", "record_event", "synchronize", "query"),
                       zs.NullEvent: ("record", "wait", "synchronize", "query"),
                       zs.Streams: ("current", "use", "fence")}
            for cls, attrs in wrapped.items():
                for attr in attrs:
                    self._wrap(cls, attr, cls.__name__)

    def remove(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()


class HostWork:
    """Count one step's host work (see the module's docstring)::

        work = HostWork()
        with work.tracking():
            ...build the system, run its first steps...
        with work.counting(model):
            work.on_device(idx, tgt)
            ...one training step...
        work.counts
    """

    def __init__(self) -> None:
        self.counts = Counts()
        self._replay = _Replay(self.counts)
        self._models: tuple[torch.nn.Module, ...] = ()
        self._stack = contextlib.ExitStack()

    def counting(self, *models: torch.nn.Module) -> "HostWork":
        """Count from ``__enter__`` on; the parameters and buffers of ``models`` live on the device."""
        self.counts = Counts()
        self._replay = _Replay(self.counts, self._replay.device)
        self._models = models
        return self

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Replay placements without counting (building a system, its first steps): tensors made before the
        counted step and kept (shards, gathered buffers, gradient buffers) are known as device tensors then."""
        with _Replay(Counts(), self._replay.device):
            yield

    def on_device(self, *tensors: torch.Tensor) -> None:
        """Tensors the caller put on the device (the batch)."""
        for t in tensors:
            self._replay.mark(t)

    def __enter__(self) -> "HostWork":
        for m in self._models:
            for t in (*m.parameters(), *m.buffers()):
                self._replay.mark(t)
        streams = _StreamCounter(self.counts)
        streams.install()
        self._stack = contextlib.ExitStack()
        self._stack.callback(streams.remove)
        self._stack.enter_context(_Dispatch(self.counts))
        self._stack.enter_context(self._replay)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
