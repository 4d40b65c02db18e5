"""fp32 master shards and Adam moments off the device, stepped by zinf's C++ CPU-Adam.

The user's torch Adam/AdamW stays the source of hyper-parameters (read from its param groups at
every step, so LR schedulers keep working); its own param groups are not stepped. As with torch's Adam, a
parameter is stepped only when it has a gradient: frozen parameters never, and a parameter no rank
produced a gradient for since the last step not in that step; each parameter keeps its own step count
for the bias correction (see [Note: stepped parameters] in zinf/param/grad_flat.py). The states live in
a state store (host memory: zinf/offload/state_store.py; NVMe records stepped as a pipeline:
zinf/offload/nvme_state_store.py), which hands the step one sub-group at a time.

[Note: background step]
With ``offload.overlap_optimizer`` the step runs on a background thread (the C++ Adam and the I/O
waits release the GIL), in the order the next forward needs the groups (below). The update fence
(``UpdateFence`` in zinf/param/store.py) holds each group until its new shard is committed and its gradient shard zeroed; its
next gather (and any NVMe read-ahead of it) waits on that. The next backward waits for every group's
update (``before_backward``), not for the state writes still trailing on disk; the next step,
checkpoints and state reads wait for the whole step (``wait``). If the step fails, every waiting
group raises the error instead of training on a half-updated model. Where the host's cores compute the model,
the training thread runs the step itself as those waits need it ([Note: a sweep the gathers drive] in
zinf/optim/driven_sweep.py).

[Note: stepped in the next forward's order]
The forward that follows a background step gathers the groups in its recorded order, each waiting for its own
update; a step that sweeps them in construction order makes the forward wait wherever the two orders differ (a
head built before the embedding, a block defined before the one that runs first, a tied weight's group). Once the
training forward's order replays (zinf/schedule/pass_state.py), the engine hands it to the optimizer (``follow``:
``ModuleHooks.forward_order``, each group where the forward first gathers it) and the sweep steps those groups in
that order, groups the forward never gathers last. On NVMe, states read ahead for the next step in the old order
are given back and read again in turn (once per change of order). Each sub-group's step is independent of the
others', so the order changes no value.

The fused pass over one sub-group is zinf/optim/fused_step.py ([Note: fused step]); the wait for a running step
at interpreter exit, zinf/optim/exit_wait.py ([Note: a background step at exit]); the state in checkpoints,
zinf/optim/offloaded_state.py.
"""

from __future__ import annotations

import logging
import math
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from zinf import native
from zinf.native import AdamHyper
from zinf.errors import UnsupportedModelError, ZinfError
from zinf.offload.grad_stash import NvmeGradStash
from zinf.optim.driven_sweep import DrivenSweep
from zinf.optim.early_steps import EarlyInputs, EarlySteps, hyper_key
from zinf.optim.exit_wait import wait_at_exit
from zinf.optim.fused_step import adam_sub_group
from zinf.optim.offloaded_state import OffloadedAdamState
from zinf.offload.subgroups import SubGroup, hyper_index
from zinf.param.store import UpdateFence
from zinf.report import StepTimers

if TYPE_CHECKING:
    from zinf.offload.record_check import RecordCheck
    from zinf.offload.device_states import DeviceStateStore
    from zinf.offload.nvme_state_store import NvmeStateStore
    from zinf.offload.state_store import CpuStateStore, StateStore
    from zinf.param.flat_group import FlatParamGroup
    from zinf.param.store import ShardStore

__all__ = ["OffloadedAdam", "check_offloadable"]

log = logging.getLogger(__name__)


def check_offloadable(optimizer: torch.optim.Optimizer) -> None:
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


def _power_of_two(f: float) -> bool:
    return f > 0.0 and math.isfinite(f) and math.frexp(f)[0] == 0.5


class OffloadedAdam(OffloadedAdamState):
    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence["FlatParamGroup"],
                 states: "CpuStateStore | NvmeStateStore", fence: UpdateFence, stash: NvmeGradStash | None = None,
                 background: bool = False, timers: StepTimers | None = None, early: bool = False,
                 device_states: "DeviceStateStore | None" = None, driven: bool = False) -> None:
        """``background``: the step overlaps the next forward, on a worker thread, or with ``driven`` on the training
        thread as its gathers need the groups ([Note: a sweep the gathers drive] in zinf/optim/driven_sweep.py)."""
        check_offloadable(optimizer)
        self.optimizer, self.states, self.fence, self.stash = optimizer, states, fence, stash
        # the groups stepped on the device ([Note: the device share] in zinf/offload/device_states.py)
        self.device_states = device_states
        self.groups = list(groups)
        self.background = background
        self.driven = driven and background and device_states is None
        self._driven: DrivenSweep | None = None  # the driven step in flight
        self.timers = timers or StepTimers()
        # one worker, made at the first background step and kept: a thread started per step made the training
        # thread wait in Thread.start() until the new thread ran, milliseconds on cores busy with the other ranks
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None  # the background step submitted last
        self._error: BaseException | None = None
        self._error_raised = False  # the error reached the caller once (close then only logs it)
        self._hyper: list[AdamHyper] = []
        self._factors: dict[int, float] = {}
        hyper = hyper_index(optimizer)
        # per parameter (group, slot): how many steps it took; None where the optimizer does not step it
        self.steps: dict[int, list[int | None]] = {
            id(g): [0 if p is not None and p.requires_grad and id(p) in hyper else None for p in g.params] for g in groups}
        self._stepped: dict[int, list[bool]] = {}
        # [Note: steps during the backward] in zinf/optim/early_steps.py
        self.early = EarlySteps(states, self.timers) if early else None  # type: ignore[arg-type]
        self._early_factor: float | None = 1.0  # the factor an early step takes (None: none is predicted)
        self._backwards = 0  # backwards since the last step
        self._followed: Sequence["FlatParamGroup"] | None = None  # the order the sweep follows now
        self._backwards_per_step = 1
        self._kept: dict[int, bool] = {}  # group -> whether its early step is the step (False: redone)

    # -- the step -------------------------------------------------------------------------------
    def follow(self, order: Sequence["FlatParamGroup"]) -> None:
        """See [Note: stepped in the next forward's order]; once the step in flight is done."""
        if order is not self._followed:
            self.wait()
            self.states.reorder(order)
            self._followed = order

    def step(self) -> None:
        """Step every sub-group and zero the gradient shards (in the background with ``background``)."""
        self.wait()
        # hyper-parameters and gradient factors as they are now: an LR scheduler stepped right after engine.step()
        # returns must not change the learning rate of sub-groups the background step has not reached yet
        self._hyper = self._hyper_now()
        self._factors = {id(g): g.grad.take_factor() for g in self.groups}
        self._stepped, self._kept = {}, {}
        for g in self.groups:  # what this step updates, taken now: the groups' flags are reset as they finish
            inputs = self._inputs(g, self._factors[id(g)], g.grad_in.used.tolist(), self._hyper)
            self._stepped[id(g)], self.steps[id(g)] = list(inputs.stepped), list(inputs.steps)
            taken = self.early.take(g) if self.early is not None else None
            if taken is not None:
                self._kept[id(g)] = taken == inputs
        self._predict_next()
        # The user's optimizer "steps" too: its parameters' gradients were all consumed (set to None) by
        # the engine, so torch skips every one of them; its step hooks run and LR schedulers see the step.
        assert all(p.grad is None for pg in self.optimizer.param_groups for p in pg["params"])
        self.optimizer.step()
        self.states.begin_step()
        try:
            self._start()
        except BaseException as exc:  # an error or a Ctrl-C before the sweep was handed over: the step failed part way
            if self._error is None:  # step counts moved and the device share may have stepped: no more training on it
                self._error = exc if isinstance(exc, Exception) else ZinfError(
                    f"zinf: the optimizer step was interrupted part way ({type(exc).__name__}); the model is partly "
                    "updated. Restart from the last checkpoint.")
            self.fence.fail(self._error)
            self.states.cancel_step()  # nothing waits for a sweep that will not run
            self._error_raised = True
            raise

    def _start(self) -> None:
        """The step from the device share to the CPU's sweep, run here or handed to the background thread."""
        for store in self._stores():  # on the training thread: a device store orders its copies after compute
            store.begin_update()
        if self.device_states is not None:  # the device share, before the CPU's sweep: the forward needs it first
            for sg, states, check in self.device_states.sweep():
                self._step(sg, states, check)
        if not self.background:
            self._run()
            return
        # a frozen group has no sub-group (see [Note: frozen groups] in zinf/param/master.py): its gathers never wait
        self.fence.begin([g for g in self.groups if self.states.of(g)])
        # interpreter exit waits for a running step (see [Note: a background step at exit] in zinf/optim/exit_wait.py)
        wait_at_exit(self)
        if self.driven:
            self._driven = DrivenSweep(self._sweep_steps(), self.fence, self.groups, self._failed)
            self.fence.drive_by(self._driven.until)
            self._driven.start()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-offloaded-adam")
        self._job = self._pool.submit(self._background)

    # -- steps during the backward (see [Note: steps during the backward] in zinf/optim/early_steps.py) ----------
    def _hyper_now(self) -> list[AdamHyper]:
        decoupled = isinstance(self.optimizer, torch.optim.AdamW)
        return [AdamHyper.from_param_group(pg, decoupled=decoupled) for pg in self.optimizer.param_groups]

    def _inputs(self, g: "FlatParamGroup", factor: float, used: list[bool], hyper: list[AdamHyper]) -> EarlyInputs:
        """What ``g``'s step takes with ``factor`` and the slots that have gradients (``used``)."""
        counts = self.steps[id(g)]
        return EarlyInputs(factor, tuple(n is not None and u for n, u in zip(counts, used)),
                           tuple(n + 1 if n is not None and u else n for n, u in zip(counts, used)),
                           hyper_key(hyper), g.grad.version)

    def on_grad_complete(self, group: "FlatParamGroup") -> None:
        if (self.early is None or self._early_factor is None or not self.states.of(group)
                or self._backwards + 1 != self._backwards_per_step or self.early.started(group)):
            return
        hyper = self._hyper_now()
        self.early.start(group, self._inputs(group, self._early_factor, group.grad_in.used.tolist(), hyper), hyper)

    def _predict_next(self) -> None:
        """The factor the next early steps take: this step's, when every group has the same power of two."""
        self._backwards_per_step, self._backwards = max(1, self._backwards), 0
        if self.early is None:
            return
        factors = {f for g, f in ((g, self._factors[id(g)]) for g in self.groups) if self.states.of(g)}
        one = factors.pop() if len(factors) == 1 else None
        self._early_factor = one if one is not None and _power_of_two(one) else None

    def drop_gradients(self) -> None:
        self._backwards = 0
        if self.early is not None:
            self.early.roll_back_all()

    def wait(self) -> None:
        """Block until a background step has finished; raise its error here (and on every later call:
        after a failed step the model is half updated and must not be trained on)."""
        if self._driven is not None:  # the rest of a driven step, here (its error, if any, is in self._error)
            driven, self._driven = self._driven, None
            try:
                driven.until(None)
                self.states.finish_writes()  # its writes, which a worker's step waits for at its end
            except BaseException as exc:  # noqa: BLE001 - raised below with the message of a failed step
                if self._error is None:
                    self._failed(exc)
        if self._job is not None:
            if not self._job.done():  # the training thread stands still for the step (an interval of the I/O note)
                with self.timers.time("optimizer_wait"):
                    futures.wait([self._job])
            self._job.result()  # _background keeps its error in self._error
            self._job = None
        if self._error is not None:
            log.error("zinf: the background optimizer step failed; the model is partly updated and will not train "
                      "further. Restart from the last checkpoint.")
            self._error_raised = True
            raise self._error

    def join_at_exit(self) -> None:
        """Wait for a background step, even one whose submission an exception cut short (its error is left for the
        log: the process is ending)."""
        if self._driven is not None and not self._driven.finished:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001 - the process is ending
                log.error("zinf: the optimizer step left to finish at exit failed: %s", exc)
            return
        job = self._job
        if job is None:
            return
        done, _ = futures.wait([job], timeout=2.0)
        if not done and job.running():  # not running after 2 s: its worker never started
            futures.wait([job])

    def close(self) -> None:
        """Finish a background step and let the workers go (the engine is closed). A failed step's error is raised
        here only where no earlier call raised it."""
        try:
            self.wait()
        except BaseException:
            if self._error_raised:
                log.warning("zinf: closing after the failed optimizer step reported earlier")
            else:
                raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self.early is not None:
                self.early.close()

    def before_backward(self) -> None:
        """Block until every group's update of a background step is done (its state writes may still be
        trailing); raise its error as ``wait`` does."""
        try:
            self.fence.wait_all()
        except BaseException:
            self.wait()
            raise

    @property
    def step_follows(self) -> bool:
        """Whether the backward starting now is the last before a step, as the last step's count of backwards
        predicts (a wrong guess costs a read, never a value)."""
        return self._backwards + 1 >= self._backwards_per_step

    def after_backward(self) -> None:
        self._backwards += 1
        if self.stash is not None:
            self.stash.flush()
        self.states.read_ahead_states()  # where the last step's writes have finished since the backward began

    def quiesce(self) -> None:
        self.wait()
        if self.early is not None:
            self.early.join()
        self.states.quiesce()

    def _failed(self, exc: BaseException) -> None:
        """A background or driven step failed part way: every waiter and every later call raises ``exc``."""
        self._error = exc
        self.fence.fail(exc)

    def _background(self) -> None:
        self.states.on_background_thread()
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._failed(exc)
        finally:
            for g in self.groups:
                self.fence.finish(g)

    def _run(self) -> None:
        for _ in self._sweep_steps():
            pass

    def _sweep_steps(self) -> Iterator[None]:
        """The sweep, one item per sub-group stepped."""
        try:
            if self.early is not None:  # the steps begun during the backward have finished
                self.early.join()
            for item in self.states.sweep():
                if item is not None:  # None: reads are in flight, nothing to step yet
                    with self.timers.time("adam"):  # the step's own time, wherever it runs (see StepReport)
                        self._step(*item)
                yield
        finally:
            for store in self._stores():
                store.end_update()

    def home(self, group: "FlatParamGroup") -> "StateStore":
        """The store holding ``group``'s master and moments."""
        if self.device_states is not None and self.device_states.of(group):
            return self.device_states
        return self.states

    def _stores(self) -> list["ShardStore"]:
        return list({id(g.store): g.store for g in self.groups}.values())

    def _finish_group(self, group: "FlatParamGroup") -> None:
        group.store.commit(group)
        group.zero_grad(memory_zeroed=True)  # zeroed by the Adam pass: [Note: fused step] in zinf/optim/fused_step.py
        self.fence.finish(group)

    def _step(self, sg: SubGroup, states: dict[str, torch.Tensor], check: "RecordCheck | None" = None) -> None:
        """See [Note: fused step] in zinf/optim/fused_step.py."""
        g = sg.group
        out = g.store.writer(g)
        fp32 = out.dtype == torch.float32
        master, m, v = states["master"], states["exp_avg"], states["exp_avg_sq"]
        if out[sg.lo :].data_ptr() == master.data_ptr():  # [Note: one fp32 master on the host]: nothing to copy
            out = None
        stashed = "grad" in states  # read from NVMe with the states (a pool buffer: nothing to zero)
        if stashed:
            grad: torch.Tensor | None = states["grad"]
        else:  # the resident shard, zeroed as it is read, for the next backward (frozen groups have none)
            resident = g.grad.resident
            grad = None if resident is None else resident[sg.lo : sg.hi]
        factor = self._factors[id(g)]
        stepped, steps = self._stepped[id(g)], self.steps[id(g)]
        kept = self._kept.get(id(g))
        if kept:  # stepped during the backward with what this step takes: that step is this one
            assert grad is not None and not stashed and out is not None
            out[sg.lo : sg.hi].copy_(master)
            grad.zero_()
            self.early.keep(sg)  # type: ignore[union-attr]
            if sg.last_of_group:
                self._finish_group(g)
            return
        if kept is False:
            self.early.roll_back(sg)  # type: ignore[union-attr]
        store = self.home(g)
        adam_sub_group(sg, master, m, v, grad, out, self._hyper, stepped, steps, factor, fp32=fp32, stashed=stashed,
                       scales=lambda j: store.layout.segment_scales(sg, states, j),
                       step_fn=native.adam_step_torch if store is self.device_states else native.adam_step, check=check)
        if sg.last_of_group:
            self._finish_group(g)

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        out = {self.states.tier: {"optimizer_state": self.states.state_bytes()}}
        if self.device_states is not None:
            out.setdefault("device", {})["optimizer_state"] = self.device_states.state_bytes()
        if self.stash is not None:
            stashed = sum(g.grad.nbytes_on_nvme() for g in self.groups)
            out.setdefault("nvme", {})["grad_shards"] = stashed
        return out
