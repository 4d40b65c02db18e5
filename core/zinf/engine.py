"""The engine: model + optimizer + config -> a model whose parameters, gradients and optimizer states
are split across the data-parallel ranks, trained with the same loop as plain PyTorch::

    engine = zinf.ZeroInfinityEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-4), config)
    for batch in loader:
        loss = engine(batch)       # forward (gathers parameters just in time)
        engine.backward(loss)      # reduce-scatters gradients into fp32 shards during backward
        engine.step()              # unscale, clip, optimizer step on the shards, zero the gradients
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from zinf.config import ZeroConfig
from zinf.offload.cleanup import stops_deferred
from zinf.errors import PartlyLoadedError, UnsupportedModelError
from zinf.heap import HeapTrimmer
from zinf.host_memory import HostMemory
from zinf.host_room import keep_room, start_heap_trims
from zinf.checkpoint import model_state
from zinf.checkpoint.sharded import load_sharded, save_sharded
from zinf.recompute import ActivationCheckpointing
from zinf.runtime.comm import Comm, compute_device
from zinf.runtime.context import RunContext
from zinf.runtime.streams import Streams
from zinf.runtime.same_host import SameHostTransport
from zinf.schedule.fetcher import ParamFetcher
from zinf.runtime.logs import install_rank_filter
from zinf.runtime.watchdog import CollectiveWatchdog
from zinf.compiling import compile_model
from zinf.backward_pass import BackwardPass
from zinf.forward_pass import ForwardPass
from zinf.placement import Placement, gather_buffers
from zinf.optim.protocol import ShardOptimizer
from zinf.param.flat_group import FlatParamGroup
from zinf.param.four_bit import refuse_change
from zinf.param.state import GroupState
from zinf.param.accounting import group_bytes, merge_bytes
from zinf.param.gathered import GatheredParameters
from zinf.param.partition import check_model, partition_model
from zinf.report import StepReport, StepTimers
from zinf.schedule.external import ExternalParamMode
from zinf.schedule.hooks import ModuleHooks
from zinf.schedule.rounds import Rounds
from zinf.schedule.tensors import map_tensors
from zinf.tiling import remap_optimizer, tile_linears
from zinf.update.accumulation import Accumulation
from zinf.update.clip import clip_grad_norm_, grad_norm
from zinf.update import torch_clip
from zinf.update.loss_scale import DynamicLossScaler, found_nonfinite
from zinf.schedule.reduce import GradReducer
from zinf import frozen_linear, integrations, shutdown
from zinf.shutdown import phase

__all__ = ["ZeroInfinityEngine", "initialize"]

log = logging.getLogger("zinf")


class ZeroInfinityEngine:
    name_prefix = ""  # a front end's own root adds it to every name (removed where names leave: state dicts, exports)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 config: ZeroConfig | None = None, *, comm: Comm | None = None,
                 device: torch.device | str | None = None) -> None:
        install_rank_filter()  # zinf logs on rank 0 only, unless ZINF_LOG_ALL_RANKS=1 or log_all_ranks(True)
        integrations.activate()  # transformers' Trainer saves and resumes this engine's model (zinf/integrations/)
        self.closed = False
        with phase("building the engine"):
            self._build(model, optimizer, config, comm, device)

    def _build(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig | None,
               comm: Comm | None, device: torch.device | str | None) -> None:
        self.config = config or ZeroConfig()
        self.device = compute_device(device)
        self.comm = (comm or Comm.current(device=self.device)).with_host_group()
        shutdown.install(self.comm.rank, self.comm.world)  # see [Note: the fault line] in zinf/native/fault.py
        self.comm = self.comm.with_same_host(SameHostTransport.connect(  # without it, the ranks on this host are counted
            self.comm, self.config.collective_timeout_s, wanted=self.config.overlap.shared_memory != "off"))
        self.module = model
        check_model(model)
        replaced = tile_linears(model, self.config.tiling, self.config.compute_dtype.itemsize, comm=self.comm)
        if optimizer is not None:
            remap_optimizer(optimizer, replaced)
        self.groups: list[FlatParamGroup] = partition_model(model, self.comm, self.config.compute_dtype, self.device,
                                                                 self.config.storage_dtype)
        for g in self.groups:  # parameters frozen after zinf.Init built them
            g.layout.check_ranks(self.comm.rank, self.comm.world, g.name)
            g.grad_in.refresh_requires_grad(g.params)
            if g.trainable:
                refuse_change(g, "training")
            g.master_shard.fit(g.trainable)  # a frozen group keeps its shard alone ([Note: frozen groups] in zinf/param/master.py)
        self.from_storage = frozen_linear.compute_from_storage(model, self.config.tiling.frozen_tile_bytes)  # narrow
        self.timers = StepTimers()
        self.grads = Accumulation()  # what the gradient shards hold between steps
        # freed gathers' memory back to the system ([Note: heap growth] in zinf/heap.py) and its account (host_memory.py)
        self.heap = HeapTrimmer(0, self.timers)  # started once the placement says what host memory is left
        self.host = HostMemory(self.heap)
        # one context for every part of this engine: its process group, streams, timers and host account
        self.ctx = RunContext(self.comm, Streams(self.device), self.timers, self.host,
                              gather_buffers(self.config.overlap, self.device))
        self.watchdog = CollectiveWatchdog(self.comm, self.config.collective_timeout_s)
        fp16, overlap = self.config.precision == "fp16", self.config.overlap
        self.placement = Placement(self.config.offload, self.groups, self.ctx, optimizer,
                                   check_finite=fp16, eager_grad_stats=fp16 or self.config.gradient_clipping > 0,
                                   moment_dtype=self.config.moment_dtype, share_pool=overlap.shared_memory == "auto")
        host = (self.comm.ranks_on_host(), self.placement.free_host_bytes)
        start_heap_trims(self.heap, self.config, self.device, sum(g.nbytes_full for g in self.groups), *host)
        room = self.comm.host_all_reduce(torch.tensor([keep_room(self.config, self.device, *host)]), "min")
        self.timers.take()  # start-up I/O is not part of the first step
        for g in self.groups:
            if g.numel <= self.config.overlap.persistent_numel:
                g.make_persistent(self.ctx)
        stepper = [self.placement.optimizer] if self.placement.optimizer is not None else []
        bucket = self.config.overlap.bucket_bytes(self.comm.backend, same_host=self.comm.same_host is not None)
        self.reducer = GradReducer(self.ctx, bucket, on_complete=stepper[0].on_grad_complete if stepper else None)
        self.rounds = Rounds(self.ctx, self.groups, self.reducer, self.config.grad_reduce_dtype,
                             strict=self.config.divergence == "error")
        self.fetcher = ParamFetcher(self.config.overlap, self.ctx, self.rounds, self.placement.read_ahead_bytes)
        # gradients land in shards a background optimizer step may still read: it is told when a backward starts/ends
        self.hooks = ModuleHooks(
            model, self.config, self.ctx, self.fetcher, self.reducer, self.rounds,
            on_backward_start=[o.before_backward for o in stepper] + [self.placement.before_backward,
                                                                     self.grads.begin_backward],
            on_backward_end=[self._count_backward, self.heap.after_backward] + [o.after_backward for o in stepper],
            unit_stages=self.placement.stages_like_one_group, keep_room=int(room))
        self.hooks.buffers.broadcast()  # as DDP's construction: every rank starts from rank 0's buffers
        external = ExternalParamMode(self.hooks) if self.config.detect_external_params else None
        self.forward_pass = ForwardPass(model, self.hooks, self.timers, external, self._prepare_inputs,
                                        self.placement.before_forward, self._entry)
        self.backward_pass = BackwardPass(self.hooks, self.grads, self.timers, self.forward_pass, self._entry,
                                          self.zero_grad)
        self.checkpointing = (ActivationCheckpointing(model, self.config.activation_checkpointing, self.hooks)
                              if self.config.activation_checkpointing.modules else None)
        self.params: list[nn.Parameter] = list(dict.fromkeys(model.parameters()))  # unique, model order
        self.optimizer: ShardOptimizer | None = self.placement.optimizer
        self.loss_scaler = DynamicLossScaler(self.config.loss_scale) if self.config.precision == "fp16" else None
        self.global_step = 0
        self.num_backward = 0
        self.last_report: StepReport | None = None
        self.load_failed: str | None = None  # set by a checkpoint load that failed part way
        self.heap.flush()  # what building the engine freed
        log.info("zinf: %d groups, %d parameters, %d per rank (world %d, %s, %s)", len(self.groups),
                 sum(g.numel for g in self.groups), sum(g.shard_numel for g in self.groups), self.comm.world,
                 self.config.precision, self.device)
        torch_clip.track(self)  # torch.nn.utils.clip_grad_norm_ of its parameters clips its shards (update/torch_clip.py)
        shutdown.track(self)  # closed at exit if the script does not (see [Note: the end of a run] in zinf/shutdown.py)

    # -- the training loop ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_pass(*args, **kwargs)

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.load_failed is not None:
            raise PartlyLoadedError(self.load_failed)
        if self.config.cast_forward_inputs and self.config.compute_dtype != torch.float32:
            return map_tensors(self._cast_input, (args, kwargs))
        return args, kwargs

    @contextlib.contextmanager
    def _entry(self, what: str) -> Iterator[None]:
        """An entry point's frame: a SIGTERM held to its end ([Note: clean stops] in zinf/offload/cleanup.py), a fault
        line or an uncaught exception naming it (zinf/shutdown.py), a collective timeout naming the silent ranks."""
        with stops_deferred(), phase(what), self.watchdog.watch(what):
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        with self.backward_pass.scope():
            loss.backward(**kwargs)

    def backward_scope(self) -> ContextManager[None]:
        """``with engine.backward_scope(): torch.autograd.backward(...)``: the engine's frame around a backward the
        caller runs itself (zinf/backward_pass.py), for a loss over several engines; fp16's loss scale is the caller's."""
        return self.backward_pass.scope()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over all shards of all ranks); returns the norm before clipping.
        A step after an explicit clip does not clip again with ``config.gradient_clipping``."""
        self._unscale()
        self.grads.mark_clipped()
        return clip_grad_norm_(self.params, self.groups, max_norm, self.comm)

    def grad_norm(self) -> torch.Tensor:
        self._unscale()
        return grad_norm(self.params, self.comm)

    def step(self) -> bool:
        """Optimizer step on the shards; returns False when an fp16 overflow skipped it."""
        with self._entry("the optimizer step"):
            return self._step()

    def _step(self) -> bool:
        if self.optimizer is None:
            raise UnsupportedModelError("zinf: engine.step() needs an optimizer; pass one to ZeroInfinityEngine(...)")
        self.grads.check_step()
        start = time.perf_counter()
        self.hooks.keep.drop()  # a forward whose backward never ran: its kept groups would go stale here
        step, skipped, grad_norm = self.global_step, False, None
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        if self.loss_scaler is not None:
            skipped = found_nonfinite(self.groups, self.comm)
        if not skipped:
            if self.config.gradient_clipping > 0 and not self.grads.clipped:
                grad_norm = float(self.clip_grad_norm_(self.config.gradient_clipping))
            self._unscale()  # with the scale the gradients were made with: the scaler adapts only after
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        if skipped:
            self.zero_grad()
        else:
            order = self.hooks.forward_order()
            if order is not None:
                self.optimizer.follow(order)
            self.optimizer.step()  # applies the gradients' pending factors, writes new shards, zeroes the gradients
            for g in self.groups:  # frozen groups never change (see [Note: frozen groups] in zinf/param/master.py)
                if g.persistent and g.owns_full and g.trainable and g.state is GroupState.GATHERED:
                    g.to_sharded()
                    g.to_gathered(self.ctx)
        self.grads.clear()
        self.global_step += int(not skipped)
        self.timers.add("optimizer", time.perf_counter() - start)
        self._finish_report(step, skipped, grad_norm, loss_scale)
        return not skipped

    def synchronize(self) -> None:
        """Wait for background work (an offloaded optimizer step, parameter shard writes) to finish;
        raises what it raised. Needed only before touching offload files from outside."""
        if self.optimizer is not None:
            self.optimizer.quiesce()
        self.placement.flush()

    def zero_grad(self) -> None:
        """Drop the gradients of the backwards since the last step; nothing to do (and no wait for a background
        step) where none ran: ``step()`` leaves the gradient shards empty, so a front end's zero_grad after it is free."""
        if self.grads.has_grads:
            if self.optimizer is not None:
                self.optimizer.wait()
                self.optimizer.drop_gradients()
            for g in self.groups:
                g.zero_grad()
        self.grads.clear()

    def _unscale(self) -> None:
        if self.loss_scaler is not None and not self.grads.unscaled:
            inv = 1.0 / self.loss_scaler.scale
            for g in self.groups:
                if g.trainable:
                    g.grad.scale(inv)
        self.grads.mark_unscaled()

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.config.compute_dtype)
        return x

    def _count_backward(self) -> None:
        self.num_backward += 1

    # -- outside training ----------------------------------------------------------------------
    def gathered_parameters(self, modifier_rank: int | None = None) -> GatheredParameters:
        """``with engine.gathered_parameters(): ...`` -- every full parameter, for reading or (with a
        modifier rank) editing; see :class:`zinf.GatheredParameters`."""
        return GatheredParameters(self.params, modifier_rank=modifier_rank, ctx=self.ctx)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """An ordinary (unsharded, fp32) state dict of the user's module, built one group at a time (collective);
        its buffers are rank 0's (with ``rank0_only=False`` on every rank too, unless ``broadcast_buffers`` is off:
        then each rank's own). See zinf/checkpoint/model_state.py."""
        return model_state.full_state_dict(self, rank0_only)

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load an ordinary (unsharded) state dict, e.g. ``full_state_dict()`` of this or an untiled model, or
        ``zinf consolidate`` output: every rank takes its shard of each parameter. Called on every rank with
        the same values. With ``strict`` a missing or unexpected key is an error before anything changes."""
        self.hooks.keep.drop()  # a forward's kept groups would keep the old values gathered
        model_state.load_full_state_dict(self, state, strict)

    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        """Every rank writes its shard of weights and optimizer state under ``path`` (a directory); once every
        rank's file is on disk, ``path/commit.json`` makes this save the current one (see
        zinf/checkpoint/commit.py). Collective."""
        with phase("saving a checkpoint"):
            save_sharded(self, path, client_state)

    def load_checkpoint(self, path: str, allow_pickle: bool | None = None) -> dict:
        """Restore what ``save_checkpoint`` wrote, on any world size and placement (see [Note: resharding] in
        zinf/checkpoint/model_state.py); returns the client state. Collective. ``allow_pickle``: whether the user
        trusts the files (``None``: the config's ``checkpoint.allow_pickle``; see docs/checkpoints.md)."""
        self.load_failed = None
        self.hooks.keep.drop()
        trusted = self.config.checkpoint.allow_pickle if allow_pickle is None else allow_pickle
        try:
            with phase("loading a checkpoint"):
                loaded = load_sharded(self, path, trusted)
        except PartlyLoadedError as exc:
            self.load_failed = str(exc)
            raise
        self.global_step = loaded.global_step
        return loaded.client_state

    def master_of(self, group: FlatParamGroup) -> torch.Tensor:
        """This rank's fp32 master shard of ``group`` (read back from its tier when offloaded)."""
        return group.master_shard.read()

    def set_master(self, group: FlatParamGroup, master: torch.Tensor) -> None:
        """Replace this rank's master shard of ``group`` and the parameter shard derived from it."""
        self.hooks.keep.drop()
        group.write_master(master)

    def report(self) -> StepReport | None:
        """The last optimizer step's time and memory breakdown (see :class:`zinf.StepReport`)."""
        return self.last_report

    def close(self, wait_for_ranks: bool = True) -> None:
        """Remove every hook and release offload files, buffers, worker threads and the ranks' shared memory;
        parameters stay partitioned. A prefetch round still in flight is applied first, so no
        collective of this engine is left pending at exit; with ``wait_for_ranks=False`` it is dropped instead and
        nothing collective runs (a process ending on an error, where the other ranks may be anywhere). A second call
        does nothing. Engines a script leaves open are closed at exit (zinf/shutdown.py). The model's groups live as
        long as its parameters or the engine do (a closed engine still reads the weights: ``full_state_dict``); on
        the device tier they go at the first garbage collection after both (nothing in a group holds it strongly)."""
        if self.closed:
            return
        with phase("closing the engine"):
            self.hooks.keep.drop()
            if wait_for_ranks and self.rounds.active and not self.rounds.failed:
                self.fetcher.apply_pending_round()
                self.fetcher.sweep()
            self.hooks.remove()
            frozen_linear.restore(self.from_storage)
            if self.checkpointing is not None:
                self.checkpointing.remove()
            try:
                self.placement.close()
            finally:  # the process group and shared memory go whatever the placement raised
                if self.ctx.buffers is not None:  # this engine's own kept gather blocks
                    self.ctx.buffers.close()
                self.comm.close()
                self.closed = True

    # -- internals -----------------------------------------------------------------------------
    def _finish_report(self, step: int, skipped: bool, grad_norm: float | None, loss_scale: float | None) -> None:
        seconds, counts = self.timers.take()
        # NVMe read waits of parameter shards and waits for a group's background update happen inside the
        # all-gather time (the gather needs the shard)
        waits = sum(seconds.get(k, 0.0) for k in ("all_gather", "reduce_scatter", "rounds", "broadcast_buffers",
                                                   "heap_trim"))
        seconds["compute"] = max(0.0, seconds.get("forward", 0.0) + seconds.get("backward", 0.0) - waits)
        fetched = self.fetcher.take_counts()
        counts["prefetched_gathers"], counts["demand_gathers"] = fetched.prefetched, fetched.demand
        counts.update(self.placement.io_counts())
        for part in (self.hooks.keep, self.ctx.buffers, self.comm.same_host):  # each one's counts since the last step
            counts.update(part.take_counts() if part is not None else {})
        floor = self.placement.nvme_floor_s(counts)  # the disk's time for these bytes (zinf info --nvme)
        if floor is not None:
            seconds["nvme_floor"] = floor
        resident = self.resident_bytes()
        # [Note: host bytes accounted]: what stays across steps, and the step's most of what came and went
        kept = sum(n for kind, n in resident.get("cpu", {}).items() if kind not in ("gathered", "grad_buffers"))
        report = StepReport(step=step, seconds=seconds, counts=counts, bytes=resident,
                            peak_gathered_bytes=fetched.peak_gathered_bytes, skipped=skipped, grad_norm=grad_norm,
                            loss_scale=loss_scale, peak_host_bytes=kept + self.host.take_peak())
        self.last_report = report
        every = self.config.log_every_n_steps
        if every and self.comm.rank == 0 and report.step % every == 0:
            log.info("zinf: %s", report.summary())

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes held by the engine right now, per tier and kind (measured from the tensors themselves)."""
        parts = [group_bytes(self.groups), self.placement.bytes_by_tier()] + ([self.optimizer.bytes_by_tier()] if self.optimizer else [])
        parts += [self.comm.same_host.bytes_by_tier()] if self.comm.same_host is not None else []
        return merge_bytes(parts)

    def compile(self, regional: bool = False, **options: Any) -> None:
        """``torch.compile`` the model in place, whole or each repeated block (``zinf.compiling.compile_model``)."""
        compile_model(self.module, regional, **options)

    def all_gathered(self) -> bool:
        """Whether every parameter is whole on this rank now (e.g. inside ``gathered_parameters()``)."""
        return all(g.state is GroupState.GATHERED for g in self.groups)


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               config: ZeroConfig | dict | None = None, **kwargs: Any) -> ZeroInfinityEngine:
    """Build an engine; ``config`` may be a ZeroConfig, a dict or an OmegaConf DictConfig."""
    if config is not None and not isinstance(config, ZeroConfig):
        config = ZeroConfig.from_dict(config)
    return ZeroInfinityEngine(model, optimizer, config, **kwargs)
