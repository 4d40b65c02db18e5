"""Streams and fences on CPU (no-ops with the same API). The CUDA behaviour is in tests/gpu/test_cuda_streams.py."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from zinf.runtime.streams import BufferFence, NullEvent, NullStream, Streams


# ---- streams and fences on CPU -------------------------------------------------------------------------

def test_cpu_streams_are_noop_stand_ins() -> None:
    s = Streams(torch.device("cpu"))
    named = s.named()
    assert list(named) == ["copy_in", "all_gather", "reduce_scatter", "copy_out"]
    assert all(isinstance(x, NullStream) for x in named.values())
    assert len({id(x) for x in named.values()}) == 4
    assert not s.is_cuda and isinstance(s.current(), NullStream)
    x = torch.arange(4.0)
    with s.use(s.copy_in):  # no stream switch, work runs as usual
        y = x * 2
    assert torch.equal(y, torch.arange(4.0) * 2)
    for stream in named.values():
        stream.wait_stream(s.current())
        event = stream.record_event()
        assert isinstance(event, NullEvent) and event.query()
        stream.wait_event(event)
        event.synchronize()
        stream.synchronize()
        assert stream.query()


def test_cpu_fence_is_free_and_holds_nothing() -> None:
    s = Streams(torch.device("cpu"))
    t = torch.ones(8)
    ref = weakref.ref(t)
    fence = s.record(s.copy_in, t)
    assert fence.num_held == 0 and fence.query()
    fence.make_wait(s.current())
    fence.wait()
    del t
    gc.collect()
    assert ref() is None, "a CPU fence must not keep tensors alive"


def test_fence_must_be_recorded_before_it_gates_anything() -> None:
    fence = Streams(torch.device("cpu")).fence()
    with pytest.raises(AssertionError, match="before record"):
        fence.wait()
    with pytest.raises(AssertionError, match="before record"):
        fence.make_wait(NullStream("compute"))


class _FakeEvent:
    """Stands for torch.cuda.Event, so the real path of BufferFence is checked without a GPU."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def record(self, stream: Any = None) -> None:
        self.calls.append(("record", stream))

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None))

    def query(self) -> bool:
        return False


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def test_fence_with_a_real_event_records_waits_and_keeps_tensors_alive() -> None:
    event, side, compute = _FakeEvent(), _FakeStream(), _FakeStream()
    fence = BufferFence(event)  # type: ignore[arg-type]
    a, b = torch.ones(2), torch.zeros(3)
    assert fence.record(side, a, b) is fence  # type: ignore[arg-type]
    assert event.calls == [("record", side)] and fence.num_held == 2 and not fence.query()
    fence.make_wait(compute)  # type: ignore[arg-type]
    assert compute.waited == [event] and fence.num_held == 2  # a stream's wait does not free the held tensors
    fence.release()
    assert fence.num_held == 0
    fence.record(side, a)  # type: ignore[arg-type]
    fence.wait()
    assert event.calls[-1] == ("synchronize", None) and fence.num_held == 0  # the host waited: nothing in flight


def test_one_spelling_per_device() -> None:
    from zinf.runtime.comm import compute_device

    assert compute_device("cpu:0") == compute_device(torch.device("cpu")) == torch.device("cpu")
    assert compute_device("meta") != compute_device("cpu")
    assert compute_device("cuda:1") == torch.device("cuda", 1) != compute_device("cuda:0")
