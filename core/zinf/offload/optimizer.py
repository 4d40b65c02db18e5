"""fp32 master shards and Adam moments off the device, stepped by zinf's C++ CPU-Adam.

The user's torch Adam/AdamW stays the source of hyper-parameters (read from its param groups at
every step, so LR schedulers keep working); its own param groups are not stepped. As with torch's Adam, a
parameter is stepped only when it has a gradient: frozen parameters never, and a parameter no rank
produced a gradient for since the last step not in that step; each parameter keeps its own step count
for the bias correction (see [Note: stepped parameters] in zinf/param/flat_group.py). This rank's shard
of each flat group is cut into sub-groups of at most ``offload.sub_group_numel`` elements. With the
"cpu" tier the states are host tensors. With "nvme" each sub-group's master, exp_avg and exp_avg_sq
are records in the swap files, and the step is a pipeline: while sub-group i is stepped, i+1 is
being read and i-1 written. The updated compute-dtype parameter is produced in the same pass
(``param_out``) straight into the parameter store's write buffer.

[Note: background step]
With ``offload.overlap_optimizer`` the step runs on a background thread (the C++ Adam and the I/O
waits release the GIL), in group order, which is the order the next forward needs them. Each group
carries ``await_update`` until its new shard is committed and its gradient shard zeroed; its next
gather (and any NVMe read-ahead of it) waits on that. The next backward waits for every group's
update (``wait_updates``), not for the state writes still trailing on disk; the next step,
checkpoints and state reads wait for the whole step (``wait``). If the step fails, every waiting
group raises the error instead of training on a half-updated model.

[Note: trailing writes]
With states on NVMe a stepped sub-group's writes are not waited for at once: they trail behind the
step while the pool has room, so the step (and the forward waiting on it) moves at the speed of the
reads and the Adam math, not of the writes. Before the next sub-group's reads are submitted, the
oldest trailing writes are finished until the pool keeps ``param_reserve_bytes`` free beyond those
reads, room the parameter store needs to stage shards for the forward and backward. Any thread that
needs a pool buffer (the step, gradient stashing in backward) may finish the oldest trailing write to
get one (``_retire_oldest``).

[Note: state read-ahead]
A step's master and moments do not depend on the gradient, so once a step's writes are done the
background thread starts reading the first sub-groups' states for the next step, into the pool room
that the backward leaves (``backward_reserve_bytes``: parameter shards to stage, gradient shards to
write); the parameter store extends it as the backward releases shards. The next step starts
from them, so the forward that waits on it is not bound by the reads of its first groups. A thread
short of pool room gives them up (last first); new state from outside (``write_states``) drops them.

[Note: gradients on NVMe]
With ``offload.grads`` on NVMe (the default when the optimizer is there) each sub-group also has a
"grad" record. When a group's gradient is complete during backward (``FlatParamGroup.grad_complete``:
after its reduce-scatter, or its last gradient with one rank) the shard's per-parameter norms (and,
for fp16, whether it is finite) are taken, it is copied into pool buffers, written, and freed, so
gradient memory is bounded by the writes in flight rather than the model. Clipping and fp16
unscaling record their factor on the group and the step applies it when it reads the gradient (the
same multiplications as on a resident shard, so results are unchanged). A later micro-batch reads a
stashed shard back before accumulating into it. The writes are finished when backward ends.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from zinf import native
from zinf.errors import UnsupportedModelError
from zinf.offload.param_store import acquire_waiting
from zinf.offload.swap import Record, SwapSpace
from zinf.report import StepTimers

if TYPE_CHECKING:
    from zinf.native import PinnedBufferPool
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["OffloadedAdam"]

log = logging.getLogger(__name__)
_STATES = ("master", "exp_avg", "exp_avg_sq")
_ALIGN_NUMEL = 1024  # sub-group boundaries stay 4096-byte aligned in fp32
_READ_AHEAD_BYTES = 64 << 20  # optimizer-state reads in flight ahead of the step, at most
_GRAD_WRITES_IN_FLIGHT = 4  # gradient sub-group writes in flight during backward (each holds a pool buffer)


def _block(nbytes: int) -> int:
    """The pool's (buddy) block size for a request of ``nbytes``."""
    return 1 << max(12, (nbytes - 1).bit_length())


@dataclass
class _SubGroup:
    group: "FlatParamGroup"
    lo: int
    hi: int
    segments: list[tuple[int, int, int, int]]  # (lo, hi, optimizer param group index, slot), group-shard coordinates
    gaps: list[tuple[int, int]]  # ranges no optimizer param group steps (padding, frozen parameters)
    last_of_group: bool
    records: dict[str, Record] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


_Reads = tuple[_SubGroup, dict[str, torch.Tensor], dict[str, int]]  # a sub-group's buffers and their reads in flight


def _hyper_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    index: dict[int, int] = {}
    for i, pg in enumerate(optimizer.param_groups):
        for p in pg["params"]:
            index[id(p)] = i
    return index


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UnsupportedModelError(
            f"zinf: offload.optimizer='cpu'/'nvme' steps with zinf's CPU-Adam, so the optimizer must be torch.optim.Adam "
            f"or AdamW (found {type(optimizer).__name__}). Use one of those, or set offload.optimizer='device'.")
    for pg in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if pg.get(flag):
                raise UnsupportedModelError(f"zinf: the offloaded CPU-Adam does not implement {flag}=True; "
                                            "turn it off or set offload.optimizer='device'.")
    if any(optimizer.state.values()):
        raise UnsupportedModelError("zinf: the optimizer has already taken steps; hand it to the engine before the first step.")


class OffloadedAdam:
    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence["FlatParamGroup"], tier: str,
                 sub_group_numel: int, swap: SwapSpace | None = None, pool: "PinnedBufferPool | None" = None,
                 background: bool = False, grads_on_nvme: bool = False, check_finite: bool = False,
                 timers: StepTimers | None = None) -> None:
        _check_optimizer(optimizer)
        assert tier in ("cpu", "nvme") and (tier == "cpu" or swap is not None)
        self.optimizer, self.tier, self.swap, self.pool = optimizer, tier, swap, pool  # pool: set before load_initial
        self.groups = list(groups)
        self.background = background
        self.timers = timers or StepTimers()
        self.make_room: Callable[[], bool] = self.free_own  # the placement's, for every user of the pool
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: dict[int, threading.Event] = {}
        self._hyper: list[_Hyper] = []
        hyper = _hyper_index(optimizer)
        # per parameter (group, slot): how many steps it took; None where the optimizer does not step it
        self.steps: dict[int, list[int | None]] = {
            id(g): [0 if p is not None and p.requires_grad and id(p) in hyper else None for p in g.params] for g in groups}
        self._stepped: dict[int, list[bool]] = {}
        # a record's trailer lives inside its span: one block less keeps a power-of-two sub-group's states
        # (and the pool's buddy blocks that stage them) at the power of two instead of rounding up to twice it
        size = max(_ALIGN_NUMEL, (sub_group_numel - 1) // _ALIGN_NUMEL * _ALIGN_NUMEL)
        self.subgroups: list[_SubGroup] = []
        for g in groups:
            runs = []
            for i, p in enumerate(g.params):
                a, b = g.local_range(i)
                if b > a and p is not None and p.requires_grad and id(p) in hyper:
                    runs.append((a, b, hyper[id(p)], i))
            for lo in range(0, g.shard_numel, size):
                hi = min(g.shard_numel, lo + size)
                segs = [(max(a, lo), min(b, hi), k, i) for a, b, k, i in runs if a < hi and b > lo]
                gaps, cursor = [], lo
                for a, b, _, _ in segs:
                    if a > cursor:
                        gaps.append((cursor, a))
                    cursor = b
                if cursor < hi:
                    gaps.append((cursor, hi))
                self.subgroups.append(_SubGroup(g, lo, hi, segs, gaps, last_of_group=hi == g.shard_numel))
        self.grads_on_nvme, self.check_finite = grads_on_nvme, check_finite
        assert not grads_on_nvme or tier == "nvme"
        self._grad_writes: list[tuple[torch.Tensor, int, Record]] = []
        # state writes trailing behind the step, oldest first; see [Note: trailing writes]
        self._trailing: collections.deque[tuple[_SubGroup, dict[str, torch.Tensor], list[int]]] = collections.deque()
        self._trailing_lock = threading.Lock()
        self.param_reserve_bytes = 0  # pool bytes trailing writes leave free for the parameter store
        # the first sub-groups' states read for the next step; see [Note: state read-ahead]
        self._preread: collections.deque[_Reads] = collections.deque()
        self.backward_reserve_bytes = 0  # pool bytes the read-ahead leaves free for the backward
        self._preread_lock = threading.Lock()  # one thread at a time extends the read-ahead
        self._writes_done = True  # the last step's state writes are finished: its records may be read ahead
        for sg in self.subgroups:
            if tier == "cpu":
                sg.tensors = {name: torch.zeros(sg.numel, dtype=torch.float32) for name in _STATES}
            else:
                sg.records = {name: swap.allocate(sg.numel * 4) for name in _STATES + (("grad",) if grads_on_nvme else ())}  # type: ignore[union-attr]
        if grads_on_nvme:
            for g in self.groups:
                g.grad_store = self

    # -- state movement (start-up, checkpoints) -------------------------------------------------
    def load_initial(self, group: "FlatParamGroup") -> None:
        """Take the fp32 master ``group`` was built with (moments start at zero); free it there."""
        assert group.master is not None
        zeros = torch.zeros_like(group.master)
        self.write_states(group, {"master": group.master, "exp_avg": zeros, "exp_avg_sq": zeros})
        group.master = None

    def _of(self, group: "FlatParamGroup") -> list[_SubGroup]:
        return [sg for sg in self.subgroups if sg.group is group]

    def read_states(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        """This rank's master and moments of ``group`` as host fp32 tensors (copies)."""
        self.wait()
        out = {name: torch.empty(group.shard_numel, dtype=torch.float32) for name in _STATES}
        for sg in self._of(group):
            for name in _STATES:
                if self.tier == "cpu":
                    out[name][sg.lo : sg.hi].copy_(sg.tensors[name])
                else:
                    rec = sg.records[name]
                    buf = self._acquire(rec.span)
                    try:
                        self.swap.wait(self.swap.submit_read(rec, buf), rec)  # type: ignore[union-attr]
                        self.swap.verify(rec, buf)  # type: ignore[union-attr]
                        out[name][sg.lo : sg.hi].copy_(buf[: rec.nbytes].view(torch.float32))
                    finally:
                        self.pool.release(buf)  # type: ignore[union-attr]
        return out

    def write_states(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        self.wait()
        while self._drop_preread():  # read before these states changed
            pass
        for sg in self._of(group):
            for name, value in states.items():
                if self.tier == "cpu":
                    sg.tensors[name].copy_(value[sg.lo : sg.hi])
                else:
                    rec = sg.records[name]
                    buf = self._acquire(rec.span)
                    try:
                        buf[: rec.nbytes].view(torch.float32).copy_(value[sg.lo : sg.hi])
                        self.swap.wait(self.swap.submit_write(rec, buf), rec)  # type: ignore[union-attr]
                    finally:
                        self.pool.release(buf)  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        moments = [self.read_states(g) for g in self.groups]
        # the hyper-parameters too, as torch's optimizers do: an LR scheduler restored on its own does not set the
        # optimizer's current lr, so a resumed run would take its first step with the lr the optimizer was built with
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        return {"param_steps": [list(self.steps[id(g)]) for g in self.groups], "param_groups": hyper,
                "exp_avg": [m["exp_avg"] for m in moments], "exp_avg_sq": [m["exp_avg_sq"] for m in moments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("param_groups")  # absent in checkpoints written before it was saved
        if saved is not None:
            if len(saved) != len(self.optimizer.param_groups):
                raise ValueError(f"zinf: the checkpoint's optimizer has {len(saved)} parameter groups, this optimizer "
                                 f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups.")
            for pg, values in zip(self.optimizer.param_groups, saved):
                pg.update({k: v for k, v in values.items() if k != "params"})
        if "param_steps" in state:
            for g, steps in zip(self.groups, state["param_steps"]):
                self.steps[id(g)] = list(steps)
        else:  # written before steps were counted per parameter: one count per optimizer param group
            hyper = _hyper_index(self.optimizer)
            for g in self.groups:
                self.steps[id(g)] = [None if n is None else int(state["steps"][hyper[id(p)]])
                                     for n, p in zip(self.steps[id(g)], g.params)]
        for g, m, v in zip(self.groups, state["exp_avg"], state["exp_avg_sq"]):
            self.write_states(g, {"exp_avg": m, "exp_avg_sq": v})

    # -- gradient shards on NVMe (see [Note: gradients on NVMe]) ---------------------------------
    def stash_grad(self, group: "FlatParamGroup", shard: torch.Tensor) -> None:
        norms = torch.stack([torch.linalg.vector_norm(shard[a:b]) for a, b in
                             (group.local_range(i) for i in range(len(group.slots)))])
        finite = bool(torch.isfinite(shard).all()) if self.check_finite else True
        group.grad_stats, group.grad_scales = (norms, finite), []
        for sg in self._of(group):
            rec = sg.records["grad"]
            buf = self._acquire(rec.span)
            buf[: rec.nbytes].view(torch.float32).copy_(shard[sg.lo : sg.hi])
            self._grad_writes.append((buf, self.swap.submit_write(rec, buf), rec))  # type: ignore[union-attr]
            while len(self._grad_writes) > _GRAD_WRITES_IN_FLIGHT:
                self._finish_grad_write()

    def _finish_grad_write(self) -> None:
        buf, handle, rec = self._grad_writes.pop(0)
        self.swap.wait(handle, rec)  # type: ignore[union-attr]
        self.pool.release(buf)  # type: ignore[union-attr]

    def flush_grads(self) -> None:
        """Finish the gradient writes still in flight (at the end of backward)."""
        while self._grad_writes:
            self._finish_grad_write()

    def load_grad(self, group: "FlatParamGroup") -> torch.Tensor:
        """A stashed gradient shard read back into memory (scales not applied: the group does that)."""
        self.flush_grads()
        out = torch.empty(group.shard_numel, dtype=torch.float32, device=group.grad_device)
        for sg in self._of(group):
            rec = sg.records["grad"]
            buf = self._acquire(rec.span)
            try:
                self.swap.wait(self.swap.submit_read(rec, buf), rec)  # type: ignore[union-attr]
                self.swap.verify(rec, buf)  # type: ignore[union-attr]
                out[sg.lo : sg.hi].copy_(buf[: rec.nbytes].view(torch.float32))
            finally:
                self.pool.release(buf)  # type: ignore[union-attr]
        return out

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> None:
        """Step every sub-group and zero the gradient shards (in the background with ``background``)."""
        self.wait()
        self._writes_done = False
        self._stepped = {}
        for g in self.groups:  # what this step updates, taken now: the groups' flags are reset as they finish
            counts, used = self.steps[id(g)], g.grad_used.tolist()
            self._stepped[id(g)] = [n is not None and u for n, u in zip(counts, used)]
            self.steps[id(g)] = [n + 1 if n is not None and u else n for n, u in zip(counts, used)]
        # hyper-parameters as they are now: an LR scheduler stepped right after engine.step() returns
        # must not change the learning rate of sub-groups the background step has not reached yet
        self._hyper = [_Hyper.of(self.optimizer, pg) for pg in self.optimizer.param_groups]
        # The user's optimizer "steps" too: its parameters' gradients were all consumed (set to None) by
        # the engine, so torch skips every one of them; its step hooks run and LR schedulers see the step.
        assert all(p.grad is None for pg in self.optimizer.param_groups for p in pg["params"])
        self.optimizer.step()
        if not self.background:
            self._run()
            return
        self._done = {id(g): threading.Event() for g in self.groups}
        for g in self.groups:
            g.await_update = lambda g=g: self._await(g)
        # not a daemon: interpreter exit waits for a running step instead of killing it inside native code
        self._thread = threading.Thread(target=self._background, name="zinf-offloaded-adam", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until a background step has finished; raise its error here (and on every later call:
        after a failed step the model is half updated and must not be trained on)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            log.error("zinf: the background optimizer step failed; the model is partly updated and will not train "
                      "further. Restart from the last checkpoint.")
            raise self._error

    def wait_updates(self) -> None:
        """Block until every group's update of a background step is done (its state writes may still be
        trailing); raise its error as ``wait`` does."""
        for event in list(self._done.values()):
            event.wait()
        if self._error is not None:
            self.wait()

    def _await(self, group: "FlatParamGroup") -> None:
        event = self._done[id(group)]
        if not event.is_set():
            with self.timers.time("optimizer_wait"):  # the background step did not stay ahead of this gather
                event.wait()
        if self._error is not None:
            self.wait()

    def _background(self) -> None:
        if self.swap is not None:
            self.swap.background.active = True
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc
        finally:
            for g in self.groups:
                if self._error is None:
                    g.await_update = None
                self._done[id(g)].set()

    def _finish_group(self, group: "FlatParamGroup") -> None:
        group.param_store.commit(group)
        group.zero_grad()
        if id(group) in self._done:
            if self._error is None:
                group.await_update = None
            self._done[id(group)].set()

    def _run(self) -> None:
        if self.tier == "cpu":
            for sg in self.subgroups:
                self._step(sg, sg.tensors)
            return
        self.flush_grads()
        with self._trailing_lock:
            reading, self._preread = self._preread, collections.deque()
        for sg, bufs, handles in reading:  # states read ahead: the gradient is read now
            if sg.group.grad_stashed:
                bufs["grad"] = self._acquire(sg.records["grad"].span)
                handles["grad"] = self.swap.submit_read(sg.records["grad"], bufs["grad"])  # type: ignore[union-attr]
        upcoming = iter(self.subgroups[len(reading):])
        following = next(upcoming, None)
        for sg in self.subgroups:
            # reads run ahead of the step by up to _READ_AHEAD_BYTES (always the sub-group stepped next),
            # and only into room the trailing writes and the parameter store leave
            while following is not None and (not reading or (self._reading_bytes(reading) < _READ_AHEAD_BYTES
                                                             and self._room_for(following))):
                reading.append((following, *self._submit_reads(following)))
                following = next(upcoming, None)
            read_sg, bufs, handles = reading.popleft()
            assert read_sg is sg
            for name in handles:
                self.swap.wait(handles[name], sg.records[name])  # type: ignore[union-attr]
                self.swap.verify(sg.records[name], bufs[name])  # type: ignore[union-attr]
            views = {name: bufs[name][: sg.records[name].nbytes].view(torch.float32) for name in handles}
            grad_buf = bufs.pop("grad", None)
            if grad_buf is not None:
                for factor in sg.group.grad_scales:  # unscale / clip, in the order they were asked for
                    views["grad"].mul_(factor)
            try:
                self._step(sg, views)
            finally:
                if grad_buf is not None:
                    self.pool.release(grad_buf)  # type: ignore[union-attr]
            writes = [self.swap.submit_write(sg.records[n], bufs[n]) for n in _STATES]  # type: ignore[union-attr]
            with self._trailing_lock:
                self._trailing.append((sg, bufs, writes))
        while self._retire_oldest():
            pass
        self._writes_done = True
        self.read_ahead_states()

    def read_ahead_states(self) -> None:
        """Extend the read-ahead of the next step's first sub-group states into the pool room there is
        now (see [Note: state read-ahead]); the parameter store calls it as the backward frees room."""
        if self.tier != "nvme" or not self._writes_done or not self._preread_lock.acquire(blocking=False):
            return
        try:
            self._extend_read_ahead()
        finally:
            self._preread_lock.release()

    def _extend_read_ahead(self) -> None:
        from zinf.native import PoolExhaustedError

        room = self.pool.capacity_bytes - self.pool.bytes_in_use - self.backward_reserve_bytes  # type: ignore[union-attr]
        while True:
            with self._trailing_lock:
                index = len(self._preread)
            if index == len(self.subgroups):
                return
            sg = self.subgroups[index]
            need = sum(_block(sg.records[n].span) for n in _STATES)
            if need > room:
                return
            bufs: dict[str, torch.Tensor] = {}
            try:
                for name in _STATES:
                    bufs[name] = self.pool.acquire(sg.records[name].span)  # type: ignore[union-attr]
            except PoolExhaustedError:
                for buf in bufs.values():
                    self.pool.release(buf)  # type: ignore[union-attr]
                return
            handles = {name: self.swap.submit_read(sg.records[name], bufs[name]) for name in _STATES}  # type: ignore[union-attr]
            with self._trailing_lock:
                # the read-ahead is a prefix of the sub-groups: if another thread gave up some of it
                # meanwhile, this one no longer follows on
                follows = len(self._preread) == index
                if follows:
                    self._preread.append((sg, bufs, handles))
            if not follows:
                for name, handle in handles.items():
                    self.swap.wait(handle, sg.records[name])  # type: ignore[union-attr]
                    self.pool.release(bufs[name])  # type: ignore[union-attr]
                return
            room -= need

    def _drop_preread(self) -> bool:
        """Give up the last sub-group read ahead for the next step; False if there is none."""
        with self._trailing_lock:
            if not self._preread:
                return False
            sg, bufs, handles = self._preread.pop()
        for name, handle in handles.items():
            self.swap.wait(handle, sg.records[name])  # type: ignore[union-attr]
            self.pool.release(bufs[name])  # type: ignore[union-attr]
        return True

    def settle(self) -> None:
        """Wait for the step in flight and give back the states read ahead: afterwards the files alone
        hold the optimizer's state."""
        self.wait()
        while self._drop_preread():
            pass

    @staticmethod
    def _reading_bytes(reading: "collections.deque[_Reads]") -> int:
        return sum(sg.records[name].span for sg, _, handles in reading for name in handles)

    def _room_for(self, sg: _SubGroup) -> bool:
        """Whether ``sg``'s reads fit in the pool beside ``param_reserve_bytes``, after finishing trailing
        writes as far as needed (see [Note: trailing writes])."""
        need = sum(_block(sg.records[n].span) for n in self._read_names(sg)) + self.param_reserve_bytes
        while self.pool.capacity_bytes - self.pool.bytes_in_use < need:  # type: ignore[union-attr]
            if not self._retire_oldest():
                return False
        return True

    def _retire_oldest(self) -> bool:
        """Finish the oldest trailing state writes and free their buffers; False if none trail."""
        with self._trailing_lock:
            if not self._trailing:
                return False
            item = self._trailing.popleft()
        self._finish_writes(*item)
        return True

    def free_own(self) -> bool:
        """Free pool room this optimizer holds without need: trailing writes first, then read-ahead."""
        return self._retire_oldest() or self._drop_preread()

    def _acquire(self, nbytes: int) -> torch.Tensor:
        return acquire_waiting(self.pool, nbytes, self.make_room)  # type: ignore[arg-type]

    @staticmethod
    def _read_names(sg: _SubGroup) -> tuple[str, ...]:
        return _STATES + (("grad",) if sg.group.grad_stashed else ())

    def _submit_reads(self, sg: _SubGroup) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        names = self._read_names(sg)
        bufs = {name: self._acquire(sg.records[name].span) for name in names}
        return bufs, {name: self.swap.submit_read(sg.records[name], bufs[name]) for name in names}  # type: ignore[union-attr]

    def _finish_writes(self, sg: _SubGroup, bufs: dict[str, torch.Tensor], handles: list[int]) -> None:
        for name, h in zip(_STATES, handles):
            self.swap.wait(h, sg.records[name])  # type: ignore[union-attr]
            self.pool.release(bufs[name])  # type: ignore[union-attr]

    def _step(self, sg: _SubGroup, states: dict[str, torch.Tensor]) -> None:
        g = sg.group
        out = g.param_store.writer(g)
        fp32 = out.dtype == torch.float32
        master, m, v = states["master"], states["exp_avg"], states["exp_avg_sq"]
        grad = states.get("grad")  # read from NVMe with the states, else the resident shard (below, only if needed)
        stepped, steps = self._stepped[id(g)], self.steps[id(g)]
        for lo, hi, k, i in sg.segments:
            h = self._hyper[k]
            a, b = lo - sg.lo, hi - sg.lo
            if not stepped[i]:  # no gradient this step: unchanged, as torch leaves a parameter whose grad is None
                out[lo:hi].copy_(master[a:b])
                continue
            if grad is None:  # a group nothing steps (all frozen or unused) never allocates a gradient shard
                grad = g.grad_shard[sg.lo : sg.hi]
            native.adam_step(master[a:b], grad[a:b], m[a:b], v[a:b], step=steps[i], lr=h.lr,
                             beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                             decoupled=h.decoupled, param_out=None if fp32 else out[lo:hi])
            if fp32:
                out[lo:hi].copy_(master[a:b])
        for lo, hi in sg.gaps:  # unstepped elements keep their values in the new shard
            out[lo:hi].copy_(master[lo - sg.lo : hi - sg.lo])
        if sg.last_of_group:
            self._finish_group(g)

    def state_bytes(self) -> int:
        return sum(sg.numel for sg in self.subgroups) * 4 * len(_STATES)

    def stashed_grad_bytes(self) -> int:
        return sum(sg.numel * 4 for sg in self.subgroups if sg.group.grad_stashed)


@dataclass(frozen=True)
class _Hyper:
    """One param group's hyper-parameters, read once per step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, pg: dict[str, Any]) -> "_Hyper":
        beta1, beta2 = pg["betas"]
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(pg.get("decoupled_weight_decay", False))
        return cls(float(pg["lr"]), float(beta1), float(beta2), float(pg["eps"]), float(pg["weight_decay"]), decoupled)
