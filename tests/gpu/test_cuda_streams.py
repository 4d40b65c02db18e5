"""Streams and fences on CUDA: the fence is what keeps a pinned buffer's reuse and a gathered parameter's read
in order (see [Note: streams] in zinf/runtime/streams.py).

Each race is made certain rather than likely: a long ``torch.cuda._sleep`` kernel is queued first on the side
stream, so the copy (or gather) it precedes has not even started when the host (or compute) goes on. Every
case runs twice: with the fence the result must be right; without it the race must be seen. The unfenced
case is the control that shows the setup can see a race, so a fence that does nothing (or is removed) makes
the fenced case fail.

Skipped without a GPU. What has run on a GPU: docs/gpu.md.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zinf.runtime.comm import Comm
from zinf.runtime.streams import Streams
from zinf.offload.swap import Record

pytestmark = pytest.mark.gpu

_NUMEL = 32 * 1024 * 1024  # 128 MiB of fp32: a host fill of it takes tens of ms
_SLEEP_CYCLES = 2_000_000_000  # about a second at GPU clock rates (1-2 GHz): far longer than the host's work


@pytest.fixture()
def streams() -> Streams:
    torch.cuda.synchronize()
    return Streams(torch.device("cuda", torch.cuda.current_device()))


def test_cuda_streams_are_real_and_prioritised(streams: Streams) -> None:
    named = streams.named()
    assert all(isinstance(s, torch.cuda.Stream) for s in named.values())
    assert len({s.cuda_stream for s in named.values()} | {streams.current().cuda_stream}) == 5
    for name in ("copy_in", "all_gather", "reduce_scatter"):
        assert named[name].priority < 0, f"{name} should be high priority, as in FSDP2"
    assert streams.copy_out.priority == 0
    with streams.use(streams.all_gather):
        assert torch.cuda.current_stream() == streams.all_gather
    assert streams.current() == torch.cuda.current_stream()


@pytest.mark.parametrize("fenced", [True, False], ids=["with_fence", "without_fence_race_is_seen"])
def test_pinned_buffer_reused_only_after_the_fence(streams: Streams, fenced: bool) -> None:
    """The pool's pinned buffer is overwritten by the host (the next NVMe read) once the H2D copy is done with it."""
    host = torch.full((_NUMEL,), 1.0, pin_memory=True)
    assert host.is_pinned()
    device = torch.empty(_NUMEL, device="cuda")  # allocated on compute: the stream that frees it
    streams.copy_in.wait_stream(streams.current())
    with streams.use(streams.copy_in):
        torch.cuda._sleep(_SLEEP_CYCLES)  # the copy below cannot start for about a second
        device.copy_(host, non_blocking=True)
    fence = streams.record(streams.copy_in)
    assert not fence.query(), "the copy should still be queued behind the sleep"
    if fenced:
        fence.wait()  # what the pool does before taking the buffer back
        assert fence.query()
    host.fill_(2.0)  # the buffer's next use
    streams.current().wait_stream(streams.copy_in)
    ones = int((device == 1.0).sum().item())
    if fenced:
        assert ones == _NUMEL, f"with the fence the device copy must hold the first values; {_NUMEL - ones} differ"
    else:
        assert ones < _NUMEL, ("without the fence the host's overwrite was expected to reach the copy (the control "
                               "that shows this test can see the race); the sleep may be too short on this GPU")


@pytest.mark.parametrize("fenced", [True, False], ids=["with_fence", "without_fence_race_is_seen"])
def test_compute_waits_for_the_all_gather_by_event(streams: Streams, fenced: bool) -> None:
    """Compute reads the gathered parameter only after the all-gather stream's event, and the host never blocks."""
    shard = torch.full((_NUMEL,), 3.0, device="cuda")
    full = torch.zeros(_NUMEL, device="cuda")  # allocated (and zeroed) on compute
    streams.all_gather.wait_stream(streams.current())  # the gather writes after the zeros
    with streams.use(streams.all_gather):
        torch.cuda._sleep(_SLEEP_CYCLES)
        Comm(rank=0, world=1).all_gather_into(full, shard, async_op=True)  # one rank: a device copy
        fence = streams.record(streams.all_gather, shard)  # the shard, read on the side stream, is kept alive
    assert fence.num_held == 1
    if fenced:
        fence.make_wait(streams.current())
        assert not fence.query(), "make_wait must not block the host"
    seen = full.clone()  # compute reads the gathered parameter
    threes = int((seen == 3.0).sum().item())
    fence.release()
    torch.cuda.synchronize()
    if fenced:
        assert threes == _NUMEL, "compute read the gathered parameter before the all-gather wrote it"
    else:
        assert threes < _NUMEL, ("without the event compute was expected to read the zeros (the control that "
                                      "shows this test can see the race); the sleep may be too short on this GPU")
    assert torch.equal(full, torch.full_like(full, 3.0))


# ---- the NVMe parameter store: a pool buffer goes back only after its copy to the device ---------------

class _PinnedPool:
    """Pinned buffers; the next NVMe read fills a released buffer at once (2.0), as the real pool's next user may."""

    def __init__(self) -> None:
        self.capacity_bytes, self.bytes_in_use = 1 << 30, 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        self.bytes_in_use += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor) -> None:
        self.bytes_in_use -= buf.numel()
        buf.view(torch.float32)[:_NUMEL].fill_(2.0)  # the buffer's next use, by the host


class _InstantSwap:
    """A "read" that has filled the buffer (with 1.0) by the time it is submitted."""

    def allocate(self, nbytes: int) -> Record:
        return Record(record_id=1, path="swap", offset=0, nbytes=nbytes)

    def submit_read(self, rec: Record, buf: torch.Tensor) -> int:
        buf[: rec.nbytes].view(torch.float32).fill_(1.0)
        return 1

    def wait(self, handle: int, rec: Record) -> None:
        pass

    def verify(self, rec: Record, buf: torch.Tensor) -> None:
        pass


class _Group:
    def __init__(self) -> None:
        self.name, self.shard_numel = "layers.0", _NUMEL
        self.compute_dtype = self.storage_dtype = torch.float32
        self.device, self.update_pending = torch.device("cuda", torch.cuda.current_device()), False


@pytest.mark.parametrize("fenced", [True, False], ids=["with_fence", "without_fence_race_is_seen"])
def test_nvme_store_waits_for_the_copy_before_the_pool_takes_the_buffer(
        streams: Streams, fenced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """NvmeShardStore.fetch copies the pool buffer to the device on copy_in; done() gives the buffer back to the
    pool only after that copy's fence. The copy is held back behind a sleep on compute (copy_in waits for it)."""
    from zinf.offload import nvme_param_store, nvme_slots
    from zinf.offload.pool_room import PoolRoom

    if not fenced:  # the control: the buffer is released without waiting for the copy
        monkeypatch.setattr(nvme_slots.Slot, "_wait_copied", lambda self: None)
    group: Any = _Group()
    swap: Any = _InstantSwap()
    room: Any = PoolRoom(_PinnedPool())  # type: ignore[arg-type]
    store = nvme_param_store.NvmeShardStore([group], swap, room, reserve_bytes=0, streams=streams)
    assert store.prefetch(group)
    torch.cuda._sleep(_SLEEP_CYCLES)  # on compute: the copy-in waits for it, so it has not started when done() runs
    shard = store.fetch(group)
    copy_in = streams.copy_in  # the streams handed to the store
    assert shard.is_cuda and not copy_in.query(), "the copy should still be queued behind the sleep"
    store.done(group)  # not kept: the buffer goes back to the pool (which overwrites it)
    torch.cuda.synchronize()
    ones = int((shard == 1.0).sum().item())
    if fenced:
        assert ones == _NUMEL, f"the pool took the buffer back before the copy read it; {_NUMEL - ones} values differ"
    else:
        assert ones < _NUMEL, ("without the fence the pool's overwrite was expected to reach the copy (the control "
                               "that shows this test can see the race); the sleep may be too short on this GPU")
    assert store.pool.bytes_in_use == 0
