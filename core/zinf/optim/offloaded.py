"""fp32 master shards and Adam moments off the device, stepped by zinf's C++ CPU-Adam.

The user's torch Adam/AdamW stays the source of hyper-parameters (read from its param groups at
every step, so LR schedulers keep working); its own param groups are not stepped. As with torch's Adam, a
parameter is stepped only when it has a gradient: frozen parameters never, and a parameter no rank
produced a gradient for since the last step not in that step; each parameter keeps its own step count
for the bias correction (see [Note: stepped parameters] in zinf/param/flat_group.py). The states live in
a state store (zinf/offload/state_store.py: host memory, or NVMe records stepped as a pipeline), which hands
the step one sub-group at a time.

[Note: fused step]
One pass per sub-group: the C++ kernel reads the gradient, master and moments once, applies the gradient's
pending factors (fp16 unscale, clip coefficient: ``GradShard.take_factor``, one float32 multiply equal to
applying them one by one), steps Adam/AdamW, writes the master, the moments and the compute-dtype
parameter shard straight into the parameter store's write buffer (``param_out``), and zeroes the resident
gradient it has just read (``zero_grad``: the cache line is already there), ready for the next backward. The norms and finiteness
that clipping and loss scaling need were taken when each gradient shard was complete (zinf/param/grad_shard.py),
so the step reads each byte once: 16 bytes per parameter in (gradient, master, two moments) and 12 + 2 out
(master, moments, bf16 shard), the floor of 30, with the gradient's zeroing folded into the same pass;
torch's clip_grad_norm_, fused AdamW and copy move 46 (54 with an fp16 unscale pass).

[Note: background step]
With ``offload.overlap_optimizer`` the step runs on a background thread (the C++ Adam and the I/O
waits release the GIL), in the order the next forward needs the groups (below). The update fence
(zinf/param/fence.py) holds each group until its new shard is committed and its gradient shard zeroed; its
next gather (and any NVMe read-ahead of it) waits on that. The next backward waits for every group's
update (``before_backward``), not for the state writes still trailing on disk; the next step,
checkpoints and state reads wait for the whole step (``wait``). If the step fails, every waiting
group raises the error instead of training on a half-updated model.

[Note: stepped in the next forward's order]
The forward that follows a background step gathers the groups in its recorded order, each waiting for its own
update; a step that sweeps them in construction order makes the forward wait wherever the two orders differ (a
head built before the embedding, a block defined before the one that runs first, a tied weight's group). Once the
training forward's order replays (zinf/schedule/trace.py), the engine hands it to the optimizer (``follow``:
``ModuleHooks.forward_order``, each group where the forward first gathers it) and the sweep steps those groups in
that order, groups the forward never gathers last. On NVMe, states read ahead for the next step in the old order
are given back and read again in turn (once per change of order). Each sub-group's step is independent of the
others', so the order changes no value.

[Note: a background step at exit]
The step runs on a worker of a one-thread ``ThreadPoolExecutor`` (made at the first background step, kept until
the engine closes), which interpreter exit joins after its queued work is done, instead of killing it inside
native code. That join only knows a worker once it started, a moment after the first submission: an exception
raised in the main thread in between leaves a step running that nobody waits for. zinf's SIGTERM handler raised
its ``SystemExit`` there (now it waits for ``step()`` to return: [Note: clean stops] in zinf/offload/cleanup.py);
a Ctrl-C still can. Finalization then stops the thread when it next takes the GIL, inside the C++ Adam's or the
I/O wait's frames, and the process aborts ("terminate called without an active exception", seen about once in ten
SIGTERMs of a small NVMe run) before the swap files are removed. So an exit handler joins every background step
once its thread is running (:func:`_join_background_steps`); registered when the first step starts, it runs before
the swap files' removal (exit handlers run last-registered first).
"""

from __future__ import annotations

import atexit
import math
import logging
import threading
import weakref
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

import torch

from zinf import native
from zinf.native import AdamHyper
from zinf.errors import UnsupportedModelError
from zinf.offload.grad_stash import NvmeGradStash
from zinf.optim.early_steps import EarlyInputs, EarlySteps, hyper_key
from zinf.offload.subgroups import SubGroup, hyper_index
from zinf.param.fence import UpdateFence
from zinf.report import StepTimers

if TYPE_CHECKING:
    from zinf.offload.state_store import CpuStateStore, NvmeStateStore
    from zinf.param.flat_group import FlatParamGroup
    from zinf.param.store import ShardStore

__all__ = ["OffloadedAdam", "check_offloadable"]

MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state proper; the stores also hold the fp32 master

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


_RUNNING: "weakref.WeakSet[OffloadedAdam]" = weakref.WeakSet()  # optimizers that started a background step
_EXIT_HANDLER = threading.Lock()
_exit_handler_registered = False


def _join_background_steps() -> None:
    """At interpreter exit: wait for every background step (see [Note: a background step at exit])."""
    for optimizer in list(_RUNNING):
        optimizer.join_at_exit()


def _register_exit_handler() -> None:
    global _exit_handler_registered
    with _EXIT_HANDLER:
        if not _exit_handler_registered:
            atexit.register(_join_background_steps)
            _exit_handler_registered = True


class OffloadedAdam:
    def __init__(self, optimizer: torch.optim.Optimizer, groups: Sequence["FlatParamGroup"],
                 states: "CpuStateStore | NvmeStateStore", fence: UpdateFence, stash: NvmeGradStash | None = None,
                 background: bool = False, timers: StepTimers | None = None, early: bool = False) -> None:
        check_offloadable(optimizer)
        self.optimizer, self.states, self.fence, self.stash = optimizer, states, fence, stash
        self.groups = list(groups)
        self.background = background
        self.timers = timers or StepTimers()
        # one worker, made at the first background step and kept: a thread started per step made the training
        # thread wait in Thread.start() until the new thread ran, milliseconds on cores busy with the other ranks
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None  # the background step submitted last
        self._error: BaseException | None = None
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
            inputs = self._inputs(g, self._factors[id(g)], g.grad_used.tolist(), self._hyper)
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
        for store in self._stores():  # on the training thread: a device store orders its copies after compute
            store.begin_update()
        if not self.background:
            self._run()
            return
        # a frozen group has no sub-group (see [Note: frozen groups] in zinf/param/flat_group.py): its gathers never wait
        self.fence.begin([g for g in self.groups if self.states.of(g)])
        # interpreter exit waits for a running step (see [Note: a background step at exit])
        _register_exit_handler()
        _RUNNING.add(self)
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
        self.early.start(group, self._inputs(group, self._early_factor, group.grad_used.tolist(), hyper), hyper)

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
        if self._job is not None:
            self._job.result()  # _background keeps its error in self._error
            self._job = None
        if self._error is not None:
            log.error("zinf: the background optimizer step failed; the model is partly updated and will not train "
                      "further. Restart from the last checkpoint.")
            raise self._error

    def join_at_exit(self) -> None:
        """Wait for a background step, even one whose submission an exception cut short (its error is left for the
        log: the process is ending)."""
        job = self._job
        if job is None:
            return
        done, _ = futures.wait([job], timeout=2.0)
        if not done and job.running():  # not running after 2 s: its worker never started
            futures.wait([job])

    def close(self) -> None:
        """Finish a background step and let the workers go (the engine is closed)."""
        self.wait()
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

    def after_backward(self) -> None:
        self._backwards += 1
        if self.stash is not None:
            self.stash.flush()

    def settle(self) -> None:
        self.wait()
        if self.early is not None:
            self.early.join()
        self.states.settle()

    def _background(self) -> None:
        self.states.on_background_thread()
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc
            self.fence.fail(exc)
        finally:
            for g in self.groups:
                self.fence.finish(g)

    def _run(self) -> None:
        try:
            if self.early is not None:  # the steps begun during the backward have finished
                self.early.join()
            with self.timers.time("adam"):  # the step's own time, wherever it runs (see StepReport)
                for sg, states in self.states.sweep():
                    self._step(sg, states)
        finally:
            for store in self._stores():
                store.end_update()

    def _stores(self) -> list["ShardStore"]:
        return list({id(g.store): g.store for g in self.groups}.values())

    def _finish_group(self, group: "FlatParamGroup") -> None:
        group.store.commit(group)
        group.zero_grad(memory_zeroed=True)  # the Adam pass zeroed what it read (see [Note: fused step])
        self.fence.finish(group)

    def _step(self, sg: SubGroup, states: dict[str, torch.Tensor]) -> None:
        """See [Note: fused step]."""
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
        for lo, hi, k, i in sg.segments:
            a, b = lo - sg.lo, hi - sg.lo
            if not stepped[i]:  # no gradient this step: unchanged, as torch leaves a parameter whose grad is None
                if out is not None:
                    out[lo:hi].copy_(master[a:b])
                if grad is not None and not stashed:
                    grad[a:b].zero_()
                continue
            if grad is None:  # stepped with no gradient memory yet (zeros): only when nothing wrote one
                grad = g.grad.tensor()[sg.lo : sg.hi]
            native.adam_step(master[a:b], grad[a:b], m[a:b], v[a:b], self._hyper[k], step=steps[i],
                             clip_coef=factor, param_out=None if fp32 or out is None else out[lo:hi],
                             zero_grad=not stashed)
            if fp32 and out is not None:
                out[lo:hi].copy_(master[a:b])
        for lo, hi in sg.gaps:  # unstepped elements keep their values in the new shard
            if out is not None:
                out[lo:hi].copy_(master[lo - sg.lo : hi - sg.lo])
            if grad is not None and not stashed:
                grad[lo - sg.lo : hi - sg.lo].zero_()
        if sg.last_of_group:
            self._finish_group(g)

    # -- state for checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.wait()
        moments = [self.states.read_states(g) for g in self.groups]
        # the hyper-parameters too, as torch's optimizers do: an LR scheduler restored on its own does not set the
        # optimizer's current lr, so a resumed run would take its first step with the lr the optimizer was built with
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        return {"param_steps": [list(self.steps[id(g)]) for g in self.groups], "param_groups": hyper,
                "exp_avg": [m["exp_avg"] for m in moments], "exp_avg_sq": [m["exp_avg_sq"] for m in moments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait()
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
            hyper = hyper_index(self.optimizer)
            for g in self.groups:
                self.steps[id(g)] = [None if n is None else int(state["steps"][hyper[id(p)]])
                                     for n, p in zip(self.steps[id(g)], g.params)]
        for g, m, v in zip(self.groups, state["exp_avg"], state["exp_avg_sq"]):
            self.states.write_states(g, {"exp_avg": m, "exp_avg_sq": v})

    # -- portable state (see [Note: portable optimizer state] in zinf/optim/protocol.py) ----------------
    def state_meta(self) -> dict[str, Any]:
        self.wait()
        hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        scalars = [[None if not n else {"step": n} for n in self.steps[id(g)]] for g in self.groups]
        return {"param_groups": hyper, "scalars": scalars}

    def state_keys(self, group: "FlatParamGroup") -> list[str]:
        return list(MOMENTS) if any(n is not None for n in self.steps[id(group)]) else []

    def group_state(self, group: "FlatParamGroup") -> dict[str, torch.Tensor]:
        if not self.state_keys(group):
            return {}
        self.wait()
        states = self.states.read_states(group)
        return {k: states[k] for k in MOMENTS}  # the master is saved with the parameters

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        self.wait()
        saved = meta["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"zinf: the checkpoint's optimizer has {len(saved)} parameter groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups.")
        for pg, values in zip(self.optimizer.param_groups, saved):
            pg.update({k: v for k, v in values.items() if k != "params"})
        for g, scalars in zip(self.groups, meta["scalars"]):
            extra = sorted({k for s in scalars if s for k in s} - {"step"})
            if extra:
                raise ValueError(f"zinf: the checkpoint's optimizer state has per-parameter {extra}, which the "
                                 "offloaded CPU-Adam does not keep: it was written by another optimizer. Load it with "
                                 "that optimizer (offload.optimizer='device').")
            self.steps[id(g)] = [None if n is None else int(s["step"]) if s else 0
                                 for n, s in zip(self.steps[id(g)], scalars)]

    def load_group_state(self, group: "FlatParamGroup", states: dict[str, torch.Tensor]) -> None:
        if not self.state_keys(group):
            return
        unknown = sorted(set(states) - set(MOMENTS))
        if unknown:
            raise ValueError(f"zinf: the checkpoint's optimizer state {unknown} is not Adam's; the offloaded CPU-Adam "
                             "cannot continue it. Load it with the optimizer that wrote it (offload.optimizer='device').")
        zeros = torch.zeros(group.shard_numel, dtype=torch.float32)
        self.states.write_states(group, {k: states.get(k, zeros) for k in MOMENTS})

    def finish_load(self) -> None:
        return None

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        out = {self.states.tier: {"optimizer_state": self.states.state_bytes()}}
        if self.stash is not None:
            stashed = sum(g.grad.nbytes_on_nvme() for g in self.groups)
            out.setdefault("nvme", {})["grad_shards"] = stashed
        return out
