"""The one place where tiers are chosen: everything a placement needs, built complete, in order.

pinned pool -> swap files -> parameter store -> gradient stash and state store -> groups placed -> initial
state moved -> optimizer. Each object is built by one constructor from what was built before it; the
pool's room-maker learns who can give room back from those constructors (the optimizer pipeline first,
then the parameter store's idle slots). The checks that a placement fits (host memory,
the pinned pool) run before anything is allocated. A device-only placement builds the device store and
the user's torch optimizer over shards, and moves nothing.

[Note: one copy on the drive]
A model built under ``zinf.Init`` with its parameters on NVMe waits in a construction spill file
(zinf/offload/spill_store.py) until the placement moves each shard to its swap record, punching the spill
record's blocks out as it goes. Swap files are preallocated when they open, so that a drive without room fails
before training starts; reserving the parameter records then too would hold every shard twice on the drive (the
spill and its swap record), which fails a model that fits the drive once (a 13B checkpoint, its spill and its
swap on one 73 GB drive). So the parameter records of shards whose spill is on the same drive are reserved one
by one, just after each shard has left the spill (``SwapSpace.reserve``): the drive holds each shard once, plus
the one in flight. The free-space check at opening counts everything else.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import torch

from zinf import native
from zinf.config_sections import OffloadConfig, OverlapConfig
from zinf.device_memory import device_is_apart
from zinf.host_room import available_ram
from zinf.native.buffer_cache import BufferCache, buffer_cache
from zinf.offload.device_states import DeviceStateStore, device_share
from zinf.offload.disk_speed import load_speed
from zinf.offload.grad_stash import NvmeGradStash, held_count
from zinf.offload.nvme_param_store import NvmeShardStore
from zinf.offload.param_store import CpuShardStore
from zinf.offload.pool_room import PoolRoom
from zinf.offload.staged_store import StagedDeviceStore
from zinf.offload.nvme_state_store import NvmeStateStore
from zinf.offload.state_store import CpuStateStore, StateStore
from zinf.offload.state_layout import StateLayout, allocate_records
from zinf.offload.subgroups import SubGroup, plan_subgroups
from zinf.offload.swap import OffloadSpaceError, Record, SwapSpace
from zinf.offload.whole_reads import whole_records
from zinf.offload.pool_needs import PoolNeeds
from zinf.optim.offloaded import OffloadedAdam, check_offloadable
from zinf.optim.protocol import ShardOptimizer
from zinf.optim.sharded import ShardedOptimizer
from zinf.param.store import UpdateFence
from zinf.param.flat_group import FlatParamGroup
from zinf.param.grad_shard import GradShard
from zinf.param.store import DEVICE_STORE, DeviceShardStore, ShardStore
from zinf.runtime.comm import Comm
from zinf.runtime.context import RunContext
from zinf.units import format_bytes

__all__ = ["Placement"]

log = logging.getLogger(__name__)


def gather_buffers(cfg: OverlapConfig, device: torch.device) -> BufferCache | None:
    """The cache gathers on the CPU take their buffers from (``overlap.gather_cache``; [Note: gather buffer cache] in
    zinf/native/buffer_cache.py); None on a GPU (its caching allocator does the same) or where it is off or
    cannot be built."""
    return buffer_cache() if cfg.gather_cache != "off" and device.type == "cpu" else None


class Placement:
    """Builds and owns the stores, the swap space and the optimizer over shards for one engine."""

    def __init__(self, cfg: OffloadConfig, groups: Sequence[FlatParamGroup], ctx: RunContext,
                 optimizer: torch.optim.Optimizer | None, check_finite: bool = False,
                 eager_grad_stats: bool = False, moment_dtype: torch.dtype = torch.float32,
                 share_pool: bool = False) -> None:
        self.cfg, self.groups = cfg, list(groups)
        self.share_pool = share_pool  # the staging pool in shared memory where the ranks share a host
        self.layout = StateLayout(moment_dtype)  # how the optimizer's states are stored (``optimizer_storage``)
        comm = ctx.comm
        # frozen shards that stay in checkpoint files (see [Note: frozen shards in place] in zinf/offload/in_place.py)
        reads_in_place = cfg.enabled and cfg.params == "nvme" and cfg.frozen_in_place
        self._in_place = {id(g): g.residence.in_place_record(g) for g in self.groups if reads_in_place
                          and not g.trainable and g.residence.in_place_record(g) is not None}
        if not (cfg.enabled and cfg.params == "nvme"):  # shards zinf.Init built straight to NVMe come back to memory
            for g in self.groups:
                g.unspill()
        self.timers = ctx.timers
        self.fence = UpdateFence(self.timers)
        offloaded_opt = cfg.optimizer != "device"
        if offloaded_opt:
            if optimizer is None:
                raise OffloadSpaceError("zinf offload: offload.optimizer is set but no optimizer was given to the engine.")
            check_offloadable(optimizer)
        # [Note: the device share] in zinf/offload/device_states.py: groups whose optimizer state stays on the device
        self.on_device = device_share(self.groups, cfg.optimizer_device_fraction) if offloaded_opt else set()
        subgroups: list[SubGroup] = (plan_subgroups(self.groups, optimizer, cfg.sub_group_numel)  # type: ignore[arg-type]
                                     if offloaded_opt else [])
        self.subgroups = [sg for sg in subgroups if id(sg.group) not in self.on_device]  # the host's (or NVMe's)
        self.grads_tier = self._choose_grads_tier()
        grads_on_nvme = self.grads_tier == "nvme"
        self._check_host_memory()
        self.free_host_bytes = self._free_host_bytes(comm.ranks_on_host())  # see trims_host_heap
        self.aio: native.AsyncIO | None = None
        self.swap: SwapSpace | None = None
        self.pool: native.PinnedBufferPool | None = None
        room: PoolRoom | None = None
        param_reserve = backward_reserve = 0
        self.pool_needs = PoolNeeds(cfg, self.groups, self._in_place, self.subgroups, self.layout, grads_on_nvme)
        # frozen groups every rank reads whole, outside the collectives ([Note: frozen groups read whole] in
        # zinf/offload/whole_reads.py): their records hold every rank's shard, where the pool can stage them
        self.whole = self.pool_needs.that_fit(whole_records(self.groups, self._in_place, comm)) \
            if reads_in_place and cfg.frozen_reads == "whole" else {}
        self._in_place.update(self.whole)
        if "nvme" in (cfg.params, cfg.optimizer):
            native.require()
            param_reserve, backward_reserve = self.pool_needs.check()
            self.aio = native.AsyncIO(block_size=cfg.aio_block_bytes, queue_depth=cfg.aio_queue_depth,
                                      num_threads=cfg.aio_threads, direct=True, bytes_per_s=cfg.aio_bytes_per_s)
            self.swap = SwapSpace(cfg.nvme_paths, comm.rank, comm.world, self.aio, timers=self.timers)
            self.pool = native.PinnedBufferPool(cfg.pinned_pool_bytes, memory=self._shared_pool_memory(cfg, comm))
            if self.pool.pin_with_cuda():  # pragma: no cover - CUDA only
                log.info("zinf offload: pinned %d MiB for NVMe staging", cfg.pinned_pool_bytes >> 20)
            room = PoolRoom(self.pool)
        # the parameter shards
        self.store: ShardStore = DEVICE_STORE
        # shards on a device apart from the host, updated by the host's CPU-Adam: staged (see [Note: staged updates])
        staged = bool(self.groups) and device_is_apart(self.groups[0].device)
        if cfg.params == "device" and offloaded_opt and staged:
            self.store = StagedDeviceStore([g for g in self.groups if id(g) not in self.on_device], ctx.streams)
        elif cfg.params == "cpu":
            self.store = CpuShardStore(self.groups, ctx.streams)
        elif cfg.params == "nvme":
            assert self.swap is not None and room is not None
            self.store = NvmeShardStore(self.groups, self.swap, room, reserve_bytes=param_reserve,
                                        in_place=self._in_place, streams=ctx.streams)
        # the optimizer's state (and the gradients it reads with it)
        self.stash: NvmeGradStash | None = None
        self.states: CpuStateStore | NvmeStateStore | None = None
        if cfg.optimizer == "cpu":
            self.states = CpuStateStore(self.subgroups, self.fence, self._host_fp32_shards(staged), self.layout)
        elif cfg.optimizer == "nvme":
            assert self.swap is not None and room is not None
            records = allocate_records(self.swap, self.subgroups, grads_on_nvme, self.layout)
            self.stash = NvmeGradStash(self.swap, room, self.subgroups, records) if grads_on_nvme else None
            self.states = NvmeStateStore(self.subgroups, self.fence, self.swap, room, records, self.stash,
                                         param_reserve, backward_reserve, self.layout)
        self.device_states = DeviceStateStore([sg for sg in subgroups if id(sg.group) in self.on_device], self.fence,
                                              self.groups[0].device) if self.on_device else None
        if cfg.enabled:
            for g in self.groups:
                off_host = offloaded_opt and id(g) not in self.on_device  # the CPU-Adam steps it
                device = torch.device("cpu") if off_host else g.device
                grad = GradShard(g, [g.layout.local_range(i) for i in range(len(g.slots))], device,
                                 stash=self.stash if off_host else None,  # the share keeps its gradients
                                 eager_stats=eager_grad_stats and off_host, check_finite=check_finite,
                                 off_device=off_host and staged)
                g.place(DEVICE_STORE if id(g) in self.on_device else self.store, grad, self.fence,
                        self._master_home(g), whole=id(g) in self.whole)
        self._deferred: dict[int, Record] = self._spill_returns() if isinstance(self.store, NvmeShardStore) else {}
        if self.swap is not None:
            self.swap.open(deferred=list(self._deferred.values()))
        self.disk_speed = load_speed(cfg.nvme_paths, cfg.aio_bytes_per_s) if self.swap is not None else None
        self._move_initial_state()
        for g in self.groups:  # a device-tier optimizer steps masters in the group: made now for groups built
            if g.trainable and g.shard_only:  # straight to NVMe (see [Note: construction spill])
                g.master_shard.restore(g.device)
        self.optimizer: ShardOptimizer | None = None
        if self.states is not None:
            self.optimizer = OffloadedAdam(optimizer, self.groups, self.states, self.fence, self.stash,  # type: ignore[arg-type]
                                           background=cfg.overlap_optimizer, timers=self.timers,
                                           early=cfg.step_during_backward, device_states=self.device_states,
                                           driven=cfg.optimizer_thread == "training" or (
                                               cfg.optimizer_thread == "auto" and not device_is_apart(ctx.device)))
        elif optimizer is not None:
            self.optimizer = ShardedOptimizer(optimizer, self.groups)

    def _master_home(self, group: FlatParamGroup) -> "StateStore | None":
        """Where a trained group's fp32 master lives with an offloaded optimizer (None: in the group)."""
        if not group.trainable or self.states is None:
            return None
        return self.device_states if id(group) in self.on_device else self.states

    def _host_fp32_shards(self, staged: bool) -> dict[int, torch.Tensor]:
        """The trained groups' parameter shards that are fp32 tensors in host memory, which the CPU-Adam can step
        as their masters (see [Note: one fp32 master on the host] in zinf/offload/state_store.py)."""
        if self.cfg.step_during_backward or staged or not isinstance(self.store, (CpuShardStore, DeviceShardStore)):
            return {}
        shards = {}
        for g in self.groups:
            shard = self.store.read(g) if g.trainable and g.storage_dtype == torch.float32 else None
            if shard is not None and shard.device.type == "cpu":
                shards[id(g)] = shard
        return shards

    def _spill_returns(self) -> dict[int, Record]:
        """[Note: one copy on the drive]: the swap records of groups whose shards wait in a construction spill file on
        the same drive, by group."""
        assert isinstance(self.store, NvmeShardStore)
        out = {}
        for g in self.groups:
            spill, rec = g.residence.spill_path, self.store.records[id(g)]
            if isinstance(rec, Record) and spill is not None and \
                    os.stat(os.path.dirname(spill)).st_dev == os.stat(os.path.dirname(rec.path)).st_dev:
                out[id(g)] = rec
        return out

    def _move_initial_state(self) -> None:
        """Hand each group's built shard and master to their stores (to NVMe: written, then freed),
        with a progress line every tenth of the groups when it goes to NVMe."""
        nvme_params = isinstance(self.store, NvmeShardStore)
        start, step = time.perf_counter(), max(1, len(self.groups) // 10)
        for i, g in enumerate(self.groups, 1):
            if nvme_params:
                self.store.write_initial(g, self._deferred.get(id(g)))  # type: ignore[union-attr]
            home = self._master_home(g)  # a frozen group has no master (see flat_group.py)
            if home is not None:
                home.take_initial(g)
            if self.swap is not None and (i % step == 0 or i == len(self.groups)):
                log.info("zinf offload: initial state of %d/%d groups written to NVMe (%.2f GiB, %.1f s)", i,
                         len(self.groups), self.swap.bytes_written / 2**30, time.perf_counter() - start)
        if self.swap is not None:
            self.swap.take_counts()  # start-up I/O is not part of the first step

    def stages_like_one_group(self, groups: Sequence[FlatParamGroup]) -> bool:
        """See ``PoolNeeds.stages_like_one_group``; always true with the parameters off NVMe (nothing is staged)."""
        return self.cfg.params != "nvme" or not self.groups or self.pool_needs.stages_like_one_group(groups)

    def _host_bytes(self, grads_tier: str) -> int:
        """Host memory this placement keeps during training, with the gradient shards on ``grads_tier``."""
        cfg = self.cfg
        # frozen: the shard alone; the device share's gradients stay on the device
        trained_numel = sum(g.shard_numel for g in self.groups if g.trainable and id(g) not in self.on_device)
        host = 0
        if cfg.params == "cpu":
            host += sum(g.shard_nbytes for g in self.groups)
        if grads_tier == "cpu":
            host += trained_numel * 4  # fp32 gradient shards
        if cfg.optimizer == "cpu":
            host += self.layout.state_bytes(self.subgroups)  # fp32 master, moments
        if "nvme" in (cfg.params, cfg.optimizer):
            host += cfg.pinned_pool_bytes
        return host

    def _host_budget(self) -> int:
        """``offload.max_cpu_bytes``, else what is free once the shards and masters that move to NVMe have left (they
        are resident now, built by ``zinf.Init``)."""
        return self.cfg.max_cpu_bytes or available_ram() + self._leaving_bytes()

    def _leaving_bytes(self) -> int:
        """Host bytes of the shards and masters that move to NVMe and are freed there (resident until then)."""
        cfg = self.cfg
        leaving: dict[int, int] = {}  # by storage: a shard that is its own master counts once
        for g in self.groups:
            for t, moves in ((g.shard, cfg.params == "nvme"), (g.master, cfg.optimizer == "nvme")):
                if moves and t is not None and t.device.type == "cpu":
                    leaving[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(leaving.values())

    def _free_host_bytes(self, ranks: int) -> int:
        """Host memory this host has left for activations, gathers and what glibc keeps, once ``ranks`` placements
        like this one keep their host bytes and their shards bound for NVMe have left (read before either)."""
        return available_ram() + ranks * (self._leaving_bytes() - self._host_bytes(self.grads_tier))

    def _choose_grads_tier(self) -> str:
        """[Note: gradients on the host] ``offload.grads: auto`` with the optimizer on NVMe keeps the gradient shards in
        host memory when they fit: within ``offload.max_cpu_bytes`` when it is set, else within half the memory
        free (the other half left to activations, gathers and the page cache the NVMe reads go through). They then
        cost no NVMe bytes: 4 written in the backward and 4 read by the step per parameter, a quarter of the
        optimizer's. Otherwise they go to NVMe with the states. Each rank decides from its own host; nothing
        depends on the ranks agreeing."""
        cfg = self.cfg
        if cfg.grads != "auto" or cfg.optimizer != "nvme":
            return cfg.grads_tier
        budget = cfg.max_cpu_bytes or self._host_budget() // 2
        tier = "cpu" if self._host_bytes("cpu") <= budget else "nvme"
        log.debug("zinf offload: gradient shards on %s (offload.grads: auto)", tier)
        return tier

    def _check_host_memory(self) -> None:
        """Host memory this placement keeps during training, against the budget (``_host_budget``)."""
        cfg = self.cfg
        host, budget = self._host_bytes(self.grads_tier), self._host_budget()
        if host > budget:
            raise OffloadSpaceError(
                f"zinf offload: this placement needs about {host / 2**30:.2f} GiB of host memory per rank, but "
                f"{'offload.max_cpu_bytes allows' if cfg.max_cpu_bytes else 'the machine has'} "
                f"{budget / 2**30:.2f} GiB. Move state to NVMe (offload.optimizer='nvme', offload.params='nvme'), "
                "use more ranks, "
                + (f"lower offload.pinned_pool_bytes (the NVMe staging pool, {format_bytes(cfg.pinned_pool_bytes)} "
                   "of it), " if "nvme" in (cfg.params, cfg.optimizer) else "")
                + "or raise offload.max_cpu_bytes.")

    # -- what the engine asks ------------------------------------------------------------------
    def before_forward(self, training: bool) -> None:
        """A training forward's shards are gathered again by its backward: the store may keep them."""
        self.store.keep_for_backward(training)

    def before_backward(self) -> None:
        self.store.keep_for_backward(False)
        step_follows = isinstance(self.optimizer, OffloadedAdam) and self.optimizer.step_follows
        if isinstance(self.store, NvmeShardStore) and step_follows:  # [Note: kept slots before an update]
            self.store.release_kept([g for g in self.groups if g.trainable and g.backward_held])
        if self.stash is not None and isinstance(self.states, NvmeStateStore):
            self.stash.hold_for_step(self._held_grads() if step_follows else [])

    def _held_grads(self) -> list[SubGroup]:
        """The sweep's first sub-groups whose gradients fit a quarter of the pool ([Note: gradients held for the
        step] in zinf/offload/grad_stash.py)."""
        assert self.stash is not None and isinstance(self.states, NvmeStateStore)
        order = self.states.subgroups
        return order[: held_count([self.stash.record(sg).span for sg in order], self.cfg.pinned_pool_bytes)]

    def flush(self) -> None:
        self.store.flush()

    def nvme_floor_s(self, counts: dict[str, int]) -> float | None:
        """The seconds the step's NVMe bytes (``counts``) take at the drives' measured speed (see
        zinf/offload/disk_speed.py); None without NVMe or without a measurement."""
        if self.swap is None or self.disk_speed is None:
            return None
        return self.disk_speed.floor_s(counts.get("nvme_read_bytes", 0), counts.get("nvme_written_bytes", 0))

    def io_counts(self) -> dict[str, int]:
        """NVMe bytes read and written since the last call."""
        if self.swap is None:
            return {}
        read, written = self.swap.take_counts()
        return {"nvme_read_bytes": read, "nvme_written_bytes": written}

    def _shared_pool_memory(self, cfg: OffloadConfig, comm: Comm) -> object:
        """The staging pool's memory, read by every rank of the host ([Note: gathering from the ranks' pools] in
        zinf/runtime/shared_pool.py), where the ranks share memory and ``share_pool``; None: the pool allocates its
        own. A collective of the ranks' transport (the same answer on every rank)."""
        transport = comm.same_host
        if not self.share_pool or transport is None or not transport.is_open:
            return None
        return transport.share_pool(comm, cfg.pinned_pool_bytes)

    @property
    def read_ahead_bytes(self) -> int:
        """The parameter shards' bytes read ahead of the running module at most: a quarter of the pool, with the
        parameters on NVMe (see [Note: reading ahead within the pool] in zinf/schedule/fetcher.py); 0 where
        nothing is read."""
        return self.pool.capacity_bytes // 4 if self.pool is not None and isinstance(self.store, NvmeShardStore) else 0

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        """Bytes the stores and the staging pool keep, per tier and kind (the optimizer reports its own)."""
        out: dict[str, dict[str, int]] = {}
        for tier, nbytes in self.store.bytes_by_tier().items():
            out.setdefault(tier, {})["param_shards"] = nbytes
        if isinstance(self.store, NvmeShardStore) and self.store.in_place_bytes():
            out["nvme"]["frozen_in_checkpoint"] = self.store.in_place_bytes()  # read from its files, not zinf's
        if self.pool is not None:
            out.setdefault("cpu", {})["pinned_pool"] = self.pool.capacity_bytes
        return out

    def close(self) -> None:
        """Close every part, each whatever the one before raised (a failed step's error, a bad record met by a
        flush): files, threads and the pool are let go, then the first error is raised."""
        error: BaseException | None = None
        for part in (self.optimizer, self.store, self.swap, self.aio, self.pool):
            try:
                if part is not None:
                    part.close()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the rest is closed
                error = error or exc
        if error is not None:
            raise error
