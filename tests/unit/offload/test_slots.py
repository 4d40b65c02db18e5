"""The NVMe parameter store's slot state machine (see [Note: NVMe parameter slots] in zinf/offload/nvme_param_store.py):
each verb moves a slot between the states the note names and refuses the moves it does not allow, and the store
drives slots through them with the eviction order of the note. The fence of a buffer's copy to the device is
waited for before the buffer goes back to the pool or is staged again; here a stand-in event records when (on
CPU the real fences are no-ops; tests/gpu/test_cuda_streams.py has the race itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import zinf.offload.nvme_param_store as nvme_param_store
from zinf.runtime.streams import BufferFence, Streams
from zinf.offload.nvme_param_store import NvmeShardStore
from zinf.offload.nvme_slots import Slot, SlotState
from zinf.offload.pool_room import PoolRoom
from zinf.offload.swap import Record

S = SlotState


class _Event:
    """Stands for torch.cuda.Event: ``log`` gets ("synchronize", name) when the host waits for it."""

    def __init__(self, log: list[tuple[str, Any]], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def query(self) -> bool:
        return False


def _fence(log: list[tuple[str, Any]], name: str = "copy") -> BufferFence:
    return BufferFence(_Event(log, name)).record(None)  # type: ignore[arg-type]


def _buf() -> torch.Tensor:
    return torch.zeros(4096, dtype=torch.uint8)


# ---- the slot on its own -------------------------------------------------------------------------------

def test_read_gather_keep_consume() -> None:
    log: list[tuple[str, Any]] = []
    slot = Slot.reading(_buf(), handle=7)
    assert (slot.state, slot.read, slot.write, slot.used, slot.idle) == (S.READING, 7, None, 0, True)
    slot.read_done()
    assert (slot.state, slot.read) == (S.FILLED, None)
    slot.hand_to_gather(_fence(log, "first"))
    assert slot.state is S.IN_USE and not slot.idle and not slot.staged
    slot.give_back(clock=3, keep=True)
    assert (slot.state, slot.used, slot.idle) == (S.KEPT, 3, True)
    slot.hand_to_gather(_fence(log, "second"))  # the backward gathers the kept shard again
    slot.give_back(clock=5, keep=False)
    assert (slot.state, slot.used) == (S.CONSUMED, 5)
    assert log == [], "nothing waits for a copy while the buffer is not reused"
    buf = slot.release()
    assert buf is slot.buf
    assert log == [("synchronize", "second")], "the last copy's fence is waited for before the pool takes the buffer"


def test_stage_commit_write() -> None:
    log: list[tuple[str, Any]] = []
    slot = Slot.staging(_buf())
    assert (slot.state, slot.staged, slot.idle) == (S.STAGED, True, False)
    slot.commit()
    assert slot.state is S.FILLED
    slot.start_write(11)
    assert slot.write == 11 and slot.idle
    slot.hand_to_gather(_fence(log))  # a gather may read the buffer while its write is in flight
    slot.give_back(clock=1, keep=False)
    assert (slot.state, slot.write) == (S.CONSUMED, 11)
    with pytest.raises(AssertionError, match="release from"):
        slot.release()  # the write still reads the buffer
    with pytest.raises(AssertionError, match="stage from"):
        slot.stage()
    slot.write_done()
    slot.stage()  # the next update rewrites the buffer in place: it waits for the copy that read it
    assert log == [("synchronize", "copy")]
    assert (slot.state, slot.used) == (S.STAGED, 0), "a staged slot counts as filled anew, not as gathered"
    slot.commit()
    slot.release()
    assert log == [("synchronize", "copy")], "a fence is waited for once"


@pytest.mark.parametrize("state", list(SlotState))
def test_moves_that_are_not_allowed(state: SlotState) -> None:
    log: list[tuple[str, Any]] = []
    slot = _to(state, log)
    allowed = {
        "read_done": {S.READING},
        "hand_to_gather": {S.FILLED, S.KEPT, S.CONSUMED, S.IN_USE},
        "give_back": {S.IN_USE},
        "stage": {S.FILLED, S.KEPT, S.CONSUMED},
        "commit": {S.STAGED},
        "start_write": {S.FILLED, S.KEPT, S.CONSUMED, S.IN_USE},
        "release": {S.FILLED, S.KEPT, S.CONSUMED},
    }
    calls = {
        "read_done": lambda s: s.read_done(),
        "hand_to_gather": lambda s: s.hand_to_gather(_fence(log)),
        "give_back": lambda s: s.give_back(1, True),
        "stage": lambda s: s.stage(),
        "commit": lambda s: s.commit(),
        "start_write": lambda s: s.start_write(5),
        "release": lambda s: s.release(),
    }
    for verb, call in calls.items():
        slot = _to(state, log)
        if state in allowed[verb]:
            call(slot)
        else:
            with pytest.raises(AssertionError):
                call(slot)
            assert slot.state is state, f"a refused {verb} must leave the slot as it was"


def _to(state: SlotState, log: list[tuple[str, Any]]) -> Slot:
    """A slot in ``state``, reached through the verbs only."""
    if state is S.READING:
        return Slot.reading(_buf(), 1)
    if state is S.STAGED:
        return Slot.staging(_buf())
    slot = Slot.reading(_buf(), 1)
    slot.read_done()
    if state is S.FILLED:
        return slot
    slot.hand_to_gather(_fence(log))
    if state is not S.IN_USE:
        slot.give_back(1, keep=state is S.KEPT)
    return slot


def test_an_unrecorded_copy_fence_is_caught_on_cpu() -> None:
    """A fetch that hands out a buffer without recording its copy would race on CUDA; the fence says so here."""
    slot = _to(S.FILLED, [])
    slot.hand_to_gather(BufferFence())
    slot.give_back(1, keep=False)
    with pytest.raises(AssertionError, match="before record"):
        slot.release()


def test_the_old_flags_are_gone() -> None:
    slot = Slot.staging(_buf())
    with pytest.raises(AttributeError):
        slot.consumed = True  # type: ignore[attr-defined]  # the six flags are gone: __slots__ only


# ---- the store driving them ----------------------------------------------------------------------------

@dataclass
class _Pool:
    log: list[tuple[str, Any]]
    capacity_bytes: int = 64 * 4096
    bytes_in_use: int = 0
    held: list[int] = field(default_factory=list)

    def acquire(self, nbytes: int) -> torch.Tensor:
        from zinf.native import PoolExhaustedError

        if self.bytes_in_use + nbytes > self.capacity_bytes:
            raise PoolExhaustedError("full")
        self.bytes_in_use += nbytes
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.held.append(buf.data_ptr())
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.log.append(("release", buf.data_ptr()))
        self.held.remove(buf.data_ptr())
        self.bytes_in_use -= buf.numel()


class _Aio:
    def __init__(self) -> None:
        self.finished: set[int] = set()

    def done(self, handle: int) -> bool:
        return handle in self.finished


class _Swap:
    """Reads and writes that complete when waited for (or when marked finished)."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log, self.aio, self._next = log, _Aio(), 0

    def allocate(self, nbytes: int) -> Record:
        self._next += 1
        return Record(record_id=self._next, path="swap", offset=0, nbytes=nbytes)

    def _handle(self, kind: str, rec: Record) -> int:
        self._next += 1
        self.log.append((kind, rec.record_id))
        return self._next

    def submit_read(self, rec: Record, buf: torch.Tensor) -> int:
        return self._handle("read", rec)

    def submit_write(self, rec: Record, buf: torch.Tensor) -> int:
        return self._handle("write", rec)

    def wait(self, handle: int, rec: Record) -> None:
        self.log.append(("wait", rec.record_id))

    def verify(self, rec: Record, buf: torch.Tensor, content: bool = True) -> None:
        pass


@dataclass(eq=False)
class _Group:
    name: str
    shard_numel: int = 256
    compute_dtype: torch.dtype = torch.float32
    storage_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    update_pending: bool = False

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.storage_dtype.itemsize


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> tuple[NvmeShardStore, list[_Group], list[tuple[str, Any]]]:
    log: list[tuple[str, Any]] = []

    def copy_in(streams: Any, group: Any, host: torch.Tensor) -> tuple[torch.Tensor, BufferFence]:
        log.append(("copy", group.name))
        return host, _fence(log, group.name)

    monkeypatch.setattr(nvme_param_store, "copy_in", copy_in)
    groups = [_Group(f"layers.{i}") for i in range(4)]
    room = PoolRoom(_Pool(log))  # type: ignore[arg-type]
    s = NvmeShardStore(groups, _Swap(log), room, reserve_bytes=0, streams=Streams(torch.device("cpu")))  # type: ignore[arg-type]
    return s, groups, log


def _state(store: NvmeShardStore, g: _Group) -> SlotState | None:
    slot = store._slots.get(id(g))
    return None if slot is None else slot.state


def test_store_waits_for_the_copy_before_the_pool_takes_the_buffer(store: Any) -> None:
    s, (g, *_), log = store
    assert s.prefetch(g)
    assert _state(s, g) is S.READING
    s.fetch(g)
    assert _state(s, g) is S.IN_USE
    log.clear()
    s.done(g)  # not kept (outside a training forward): dropped at once
    assert _state(s, g) is None
    assert [e[0] for e in log] == ["synchronize", "release"], log


def test_store_waits_for_the_copy_before_staging_the_buffer_again(store: Any) -> None:
    s, (g, *_), log = store
    s.keep_for_backward(True)
    s.prefetch(g)
    s.fetch(g)
    s.done(g)
    assert _state(s, g) is S.KEPT
    log.clear()
    s.writer(g)  # the optimizer's update is written into the buffer the gather copied
    assert _state(s, g) is S.STAGED and log == [("synchronize", g.name)]
    s.commit(g)
    assert _state(s, g) is S.FILLED and s._slots[id(g)].write is not None


def test_store_eviction_order(store: Any) -> None:
    """Consumed slots first, then gathered ones least recently used first, then the most recently filled."""
    s, groups, log = store
    a, b, c, d = groups
    s.keep_for_backward(True)
    for g in (a, b):
        s.prefetch(g)
        s.fetch(g)
        s.done(g)  # kept, a used before b
    s.prefetch(c)  # read ahead, not gathered
    s.writer(d)
    s.commit(d)  # updated, its write in flight
    s.keep_for_backward(False)
    s.fetch(d)
    s.done(d)  # not kept: consumed, waiting for its write
    assert [_state(s, g) for g in groups] == [S.KEPT, S.KEPT, S.READING, S.CONSUMED]
    order = []
    while True:
        before = {g.name for g in groups if id(g) in s._slots}
        if not s.room.make_room():  # the store is the pool's evictor for parameters
            break
        order += sorted(before - {g.name for g in groups if id(g) in s._slots})
    assert order == ["layers.3", "layers.0", "layers.1", "layers.2"]
    assert s.pool.bytes_in_use == 0


def test_store_reaps_a_consumed_slot_once_its_write_finished(store: Any) -> None:
    s, (g, *_), log = store
    s.writer(g)
    s.commit(g)
    write = s._slots[id(g)].write
    s.fetch(g)
    s.done(g)
    assert _state(s, g) is S.CONSUMED
    s.swap.aio.finished.add(write)
    s._reap()  # what every call into the store does first
    assert _state(s, g) is None and s.pool.bytes_in_use == 0


def test_store_flush_leaves_only_busy_slots(store: Any) -> None:
    s, (a, b, *_), log = store
    s.prefetch(a)
    s.fetch(a)  # in use by a gather: flush leaves it
    s.writer(b)  # being staged: flush leaves it
    s.flush()
    assert _state(s, a) is S.IN_USE and _state(s, b) is S.STAGED
    s.done(a)
    s.commit(b)
    s.flush()
    assert s._slots == {} and s.pool.bytes_in_use == 0
