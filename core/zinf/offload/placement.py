"""The one place where offload tiers are chosen: stores for parameters and optimizer states, the
swap space and pinned pool they share, and the checks that a placement fits before training starts."""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import torch

from zinf import native
from zinf.config import OffloadConfig
from zinf.fetch.comm import Comm
from zinf.offload.optimizer import _GRAD_WRITES_IN_FLIGHT, OffloadedAdam, _block
from zinf.offload.param_store import CpuParamStore, NvmeParamStore, ParamStore
from zinf.offload.swap import OffloadSpaceError, SwapSpace
from zinf.param.flat_group import FlatParamGroup
from zinf.report import StepTimers
from zinf.units import format_bytes

__all__ = ["Placement"]

log = logging.getLogger(__name__)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")  # pragma: no cover - non-Linux


class Placement:
    """Builds and owns the offload machinery for one engine; ``optimizer`` is the offloaded Adam or None."""

    def __init__(self, cfg: OffloadConfig, groups: Sequence[FlatParamGroup], comm: Comm,
                 optimizer: torch.optim.Optimizer | None, timers: StepTimers | None = None,
                 check_finite: bool = False) -> None:
        self.cfg, self.groups = cfg, list(groups)
        self.swap: SwapSpace | None = None
        self.pool = None
        self.aio = None
        if "nvme" in (cfg.params, cfg.optimizer):
            native.require()
            self.aio = native.AsyncIO(block_size=cfg.aio_block_bytes, queue_depth=cfg.aio_queue_depth,
                                      num_threads=cfg.aio_threads, direct=True)
            self.swap = SwapSpace(cfg.nvme_paths, comm.rank, comm.world, self.aio, timers=timers)
        self.param_store: ParamStore = {"device": ParamStore, "cpu": CpuParamStore}.get(cfg.params, ParamStore)()
        if cfg.params == "nvme":
            assert self.swap is not None
            self.param_store = NvmeParamStore(self.swap, pool=None)  # type: ignore[arg-type]  # pool set below
        for g in self.groups:
            self.param_store.attach(g)
            if cfg.params != "device":
                g.separate_full()
        self.optimizer: OffloadedAdam | None = None
        if cfg.optimizer != "device":
            if optimizer is None:
                raise OffloadSpaceError("zinf offload: offload.optimizer is set but no optimizer was given to the engine.")
            self.optimizer = OffloadedAdam(optimizer, self.groups, cfg.optimizer, cfg.sub_group_numel, self.swap, None,
                                           background=cfg.overlap_optimizer, grads_on_nvme=cfg.grads_tier == "nvme",
                                           check_finite=check_finite, timers=timers)
            for g in self.groups:
                g.grad_device = torch.device("cpu")
                g.master_sink = lambda values, g=g: self.optimizer.write_states(g, {"master": values})  # type: ignore[union-attr]
        self._check_host_memory()
        if self.swap is not None:
            self.pool = native.PinnedBufferPool(self._pool_bytes())
            if self.pool.pin_with_cuda():  # pragma: no cover - CUDA only
                log.info("zinf offload: pinned %d MiB for NVMe staging", cfg.pinned_pool_bytes >> 20)
            if isinstance(self.param_store, NvmeParamStore):
                self.param_store.pool = self.pool
            if self.optimizer is not None:
                self.optimizer.pool = self.pool
                self.optimizer.make_room = self._make_room
            if isinstance(self.param_store, NvmeParamStore):
                self.param_store.make_room = self._make_room
                if self.optimizer is not None:
                    self.param_store.on_room = self.optimizer.read_ahead_states
            self.swap.open()
        self._move_initial_state()

    def _make_room(self) -> bool:
        """Free one piece of the pinned pool that is not needed right now, for whoever is short of room:
        the optimizer's trailing writes or state read-ahead, then the parameter store's idle slots."""
        if self.optimizer is not None and self.optimizer.free_own():
            return True
        return isinstance(self.param_store, NvmeParamStore) and self.param_store.evict_one()

    def _move_initial_state(self) -> None:
        """Hand each group's built shard and master to their stores (to NVMe: written, then freed),
        with a progress line every tenth of the groups when it goes to NVMe."""
        nvme_params = isinstance(self.param_store, NvmeParamStore)
        to_nvme = nvme_params or (self.optimizer is not None and self.cfg.optimizer == "nvme")
        start, step = time.perf_counter(), max(1, len(self.groups) // 10)
        for i, g in enumerate(self.groups, 1):
            if nvme_params:
                self.param_store.write_initial(g)  # type: ignore[attr-defined]
            if self.optimizer is not None:
                self.optimizer.load_initial(g)
            if to_nvme and (i % step == 0 or i == len(self.groups)) and self.swap is not None:
                log.info("zinf offload: initial state of %d/%d groups written to NVMe (%.2f GiB, %.1f s)", i,
                         len(self.groups), self.swap.bytes_written / 2**30, time.perf_counter() - start)
        if self.swap is not None:
            self.swap.bytes_read = self.swap.bytes_written = 0  # start-up I/O is not part of the first step

    def _pool_bytes(self) -> int:
        """Check the pool can hold what must never wait for room, and set how much of it each user leaves.

        Never waits: the offloaded optimizer's pipeline (three states each, and the gradient when it is on
        NVMe, for the sub-groups read ahead, stepped and written behind) and, with parameters on NVMe, the
        largest shard three times (one read for a gather, one updated shard staged, one being written), in
        the pool's power-of-two block sizes; plus room to read one shard ahead. Everything beyond that is
        opportunistic and given back on demand (``_make_room``): parameter read-ahead and kept shards leave
        ``3 x largest shard`` free, the optimizer's trailing writes the same, and its read-ahead of the next
        step's states leaves what the backward needs (those shards, gradient writes, a quarter of the pool
        for parameter read-ahead)."""
        pipeline = largest = 0
        if self.optimizer is not None and self.cfg.optimizer == "nvme":
            per_subgroup = 4 if self.optimizer.grads_on_nvme else 3  # master, exp_avg, exp_avg_sq (, grad)
            pipeline = 3 * per_subgroup * _block(max(r.span for sg in self.optimizer.subgroups for r in sg.records.values()))
        if isinstance(self.param_store, NvmeParamStore):
            largest = _block(max(r.span for r in self.param_store.records.values()))
            self.param_store.reserve_bytes = 3 * largest
        need = pipeline + (4 * largest if largest else 0)
        if self.optimizer is not None:
            self.optimizer.param_reserve_bytes = 3 * largest
            grad_writes = 0
            if self.optimizer.grads_on_nvme:
                largest_grad = max(sg.records["grad"].span for sg in self.optimizer.subgroups)
                grad_writes = (_GRAD_WRITES_IN_FLIGHT + 1) * _block(largest_grad)
            self.optimizer.backward_reserve_bytes = 3 * largest + grad_writes + self.cfg.pinned_pool_bytes // 4
        if need > self.cfg.pinned_pool_bytes:
            raise OffloadSpaceError(
                f"zinf offload: offload.pinned_pool_bytes = {self.cfg.pinned_pool_bytes} is too small for this model; "
                f"staging the largest groups and optimizer sub-groups needs about {need} bytes. Raise "
                "offload.pinned_pool_bytes, or lower offload.sub_group_numel.")
        return self.cfg.pinned_pool_bytes

    def _check_host_memory(self) -> None:
        """Host memory this placement keeps during training, against what is free once the shards and
        masters that move to NVMe have left (they are resident now, built by ``zinf.Init``)."""
        shard_numel = sum(g.shard_numel for g in self.groups)
        host = 0
        if self.cfg.params == "cpu":
            host += shard_numel * self.groups[0].compute_dtype.itemsize if self.groups else 0
        if self.cfg.grads_tier == "cpu":
            host += shard_numel * 4  # fp32 gradient shards
        if self.cfg.optimizer == "cpu":
            host += shard_numel * 12  # fp32 master, exp_avg, exp_avg_sq
        if self.swap is not None:
            host += self.cfg.pinned_pool_bytes
        leaving: dict[int, int] = {}  # host storages that move to NVMe and are freed there
        for g in self.groups:
            for t, moves in ((g.shard, self.cfg.params == "nvme"), (g.master, self.cfg.optimizer == "nvme")):
                if moves and t is not None and t.device.type == "cpu":
                    leaving[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        budget = self.cfg.max_cpu_bytes or _available_ram() + sum(leaving.values())
        if host > budget:
            raise OffloadSpaceError(
                f"zinf offload: this placement needs about {host / 2**30:.2f} GiB of host memory per rank, but "
                f"{'offload.max_cpu_bytes allows' if self.cfg.max_cpu_bytes else 'the machine has'} "
                f"{budget / 2**30:.2f} GiB. Move state to NVMe (offload.optimizer='nvme', offload.params='nvme'), "
                "use more ranks, "
                + (f"lower offload.pinned_pool_bytes (the NVMe staging pool, {format_bytes(self.cfg.pinned_pool_bytes)} "
                   "of it), " if self.swap is not None else "")
                + "or raise offload.max_cpu_bytes.")

    def bytes_by_tier(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        if isinstance(self.param_store, NvmeParamStore):
            out.setdefault("nvme", {})["param_shards"] = sum(r.span for r in self.param_store.records.values())
        if self.optimizer is not None:
            tier = "nvme" if self.cfg.optimizer == "nvme" else "cpu"
            out.setdefault(tier, {})["optimizer_state"] = self.optimizer.state_bytes()
            if self.optimizer.grads_on_nvme:
                out.setdefault("nvme", {})["grad_shards"] = self.optimizer.stashed_grad_bytes()
        if self.pool is not None:
            out.setdefault("cpu", {})["pinned_pool"] = self.pool.capacity_bytes
        return out

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.settle()
        self.param_store.close()
        if self.swap is not None:
            self.swap.close()
        if self.aio is not None:
            self.aio.close()
        if self.pool is not None:
            self.pool.close()
