"""The sections of the engine config: one dataclass per nested key of ``ZeroConfig`` (``loss_scale``, ``overlap``,
``offload``, ``tiling``, ``activation_checkpointing``, ``checkpoint``), each checking its own values when built.

``zinf.config`` re-exports every one of them with ``ZeroConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zinf.config_build import Checked, require
from zinf.config_types import check_types
from zinf.units import format_bytes

__all__ = ["LossScaleConfig", "OverlapConfig", "OffloadConfig", "TilingConfig", "CheckpointingConfig",
           "CheckpointConfig", "TIERS", "RESHARD_AFTER_FORWARD"]

TIERS = ("device", "cpu", "nvme")
RESHARD_AFTER_FORWARD = ("auto", "always", "never")  # overlap.reshard_after_forward (zinf plan takes the same)


@dataclass(kw_only=True)
class LossScaleConfig(Checked):
    """Dynamic loss scaling for ``precision="fp16"`` (ignored otherwise)."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def validate(self) -> None:
        check_types(self, "loss_scale.")
        require(self.initial_scale > 0, "loss_scale.initial_scale", self.initial_scale, "a positive number")
        require(self.growth_factor > 1, "loss_scale.growth_factor", self.growth_factor, "a number > 1")
        require(0 < self.backoff_factor < 1, "loss_scale.backoff_factor", self.backoff_factor, "a number in (0, 1)")
        require(self.growth_interval >= 1, "loss_scale.growth_interval", self.growth_interval, "an integer >= 1")
        require(self.min_scale > 0, "loss_scale.min_scale", self.min_scale, "a positive number")


@dataclass(kw_only=True)
class OverlapConfig(Checked):
    """How far ahead parameters are gathered and how gradients are bucketed.

    ``prefetch_bytes`` bounds the bytes of gathered-ahead parameters, but the next group is gathered ahead
    whatever its size when nothing else is (0 turns prefetch off);
    ``persistent_numel`` keeps modules whose own parameters are smaller than this gathered for the
    whole run; gradients are reduce-scattered in buckets of about ``reduce_bucket_bytes`` (small
    groups coalesced into one collective), at most two buckets in flight; 0 (default) sizes them by the
    backend: 4 MiB with gloo, where the last bucket's reduce is the wait at the end of the backward and smaller
    buckets shorten it until each collective's fixed cost dominates; 16 MiB with NCCL, where each collective
    costs a launch (measured: docs/benchmarks.md, "Measurements behind the defaults"). ``max_gathered_bytes`` (0: no
    limit) caps the bytes of full parameters gathered at once, prefetched ones included: prefetch stays
    under it, and a module that alone needs more is an error that names it (tile it: ``tiling``).
    ``coalesce_gathers`` ("auto", "on", "off") issues the gathers every rank agreed on in one round as one
    collective per dtype (see [Note: one collective per round] in zinf/runtime/collectives.py) instead of one
    all-gather per group. "auto" (default) and "on": coalesced on every backend (with NCCL one grouped launch
    for a whole block, as FSDP2 issues one all-gather per block); "off": one all-gather per group.
    ``reshard_after_forward`` says which groups go back to their shards after their module's forward (see
    [Note: kept for backward] in zinf/schedule/keep.py): "auto" (default) all but the ones the backward gathers
    first, as many as fit ``prefetch_bytes`` (and half of ``max_gathered_bytes``; computing on the CPU, also a room
    of host memory: [Note: keeping in the host's room] in zinf/schedule/keep.py), which stay gathered from their
    last use in the forward into their backward, and, whatever their size, those of the modules the backward starts
    with where the forward ends with them (the output layer, the root); "always" every group (ZeRO-3 as DeepSpeed
    runs it: the backward gathers everything again); "never" none that the backward gathers, as FSDP2's ``reshard_after_forward=False``:
    one all-gather per parameter a step instead of two, for the memory of the whole model's parameters gathered
    at the end of the forward (under ``max_gathered_bytes`` only what fits it).
    ``shared_memory`` ("auto", "chunks", "off"): with "auto" (default), gloo ranks that compute on the CPU of one
    host all-gather parameters and reduce-scatter gradients through shared memory (``/dev/shm``) instead of gloo's
    sockets, 16 MiB of it per rank (see [Note: same-host collectives] in zinf/runtime/same_host.py), and the NVMe
    staging pool lies there too, so a shard read into one rank's pool is gathered by the others from it (see [Note:
    gathering from the ranks' pools] in zinf/runtime/shared_pool.py); "chunks": the collectives through shared
    memory, the pool private; "off": always through the process group.
    ``gather_cache`` ("auto", "off"): with "auto" (default), gathers on the CPU take their buffers' memory from a
    cache that keeps freed blocks mapped for the next gather of the same size, within 1.25 times the most ever
    gathered at once and one block; with the parameters offloaded, frozen groups' gathers only (see [Note: gather
    buffer cache] in zinf/native/buffer_cache.py); "off": fresh memory each gather.
    ``host_keep`` ("auto", "off"): with "auto" (default), computing on the CPU with ``reshard_after_forward``
    "auto" and nothing bounding the gathers (no ``max_gathered_bytes``, no ``offload.max_cpu_bytes``), groups are
    also kept for the backward in a room of host memory: a quarter of what the placements leave free, split between
    the host's ranks ([Note: keeping in the host's room] in zinf/schedule/keep.py); "off": ``prefetch_bytes`` only.
    """

    prefetch_bytes: int = 64 * 2**20
    prefetch_modules: int = 4
    persistent_numel: int = 0
    reduce_bucket_bytes: int = 0
    max_gathered_bytes: int = 0
    coalesce_gathers: str = "auto"
    reshard_after_forward: str = "auto"
    shared_memory: str = "auto"
    gather_cache: str = "auto"
    host_keep: str = "auto"

    def validate(self) -> None:
        check_types(self, "overlap.")
        require(self.prefetch_bytes >= 0, "overlap.prefetch_bytes", self.prefetch_bytes, "an integer >= 0")
        require(self.max_gathered_bytes >= 0, "overlap.max_gathered_bytes", self.max_gathered_bytes,
                 "an integer >= 0 (0 = no limit)")
        require(self.prefetch_modules >= 0, "overlap.prefetch_modules", self.prefetch_modules, "an integer >= 0")
        require(self.persistent_numel >= 0, "overlap.persistent_numel", self.persistent_numel, "an integer >= 0")
        require(self.coalesce_gathers in ("auto", "on", "off"), "overlap.coalesce_gathers", self.coalesce_gathers,
                 "one of ['auto', 'on', 'off'] ('off': one all-gather per group)")
        require(self.reshard_after_forward in RESHARD_AFTER_FORWARD, "overlap.reshard_after_forward",
                 self.reshard_after_forward, f"one of {list(RESHARD_AFTER_FORWARD)} ('never': keep every group "
                 "gathered from its forward to its backward)")
        require(self.shared_memory in ("auto", "chunks", "off"), "overlap.shared_memory", self.shared_memory,
                 "one of ['auto', 'chunks', 'off'] ('chunks': the staging pool private; 'off': every collective "
                 "through the process group)")
        require(self.gather_cache in ("auto", "off"), "overlap.gather_cache", self.gather_cache,
                 "one of ['auto', 'off'] ('off': fresh memory for every gather)")
        require(self.host_keep in ("auto", "off"), "overlap.host_keep", self.host_keep,
                 "one of ['auto', 'off'] ('off': only prefetch_bytes keeps groups for the backward)")
        require(self.reduce_bucket_bytes >= 0, "overlap.reduce_bucket_bytes", self.reduce_bucket_bytes,
                 "an integer >= 0 (0: sized by the backend)")

    def bucket_bytes(self, backend: str, same_host: bool = False) -> int:
        """The reduce-scatter bucket size on ``backend`` (``reduce_bucket_bytes``, or the backend's default; through
        shared memory a collective costs no round trip, so each group goes alone and is not copied into a bucket)."""
        if self.reduce_bucket_bytes:
            return self.reduce_bucket_bytes
        if same_host:
            return 0
        return 4 * 2**20 if backend == "gloo" else 16 * 2**20

    def coalesces(self, backend: str) -> bool:
        """Whether a round's gathers go out as one collective on ``backend`` (``coalesce_gathers``)."""
        return self.coalesce_gathers != "off"


@dataclass(kw_only=True)
class OffloadConfig(Checked):
    """Where each kind of state lives between uses (ZeRO-Infinity's offload engine).

    params: this rank's compute-dtype parameter shards: "device" (default), "cpu" or "nvme".
    optimizer: fp32 master shards and Adam moments: "device" (the user's torch optimizer steps them
        in place), "cpu" or "nvme" (zinf's C++ CPU-Adam steps them, sub-group by sub-group; with
        "nvme" reading the next sub-group, stepping this one and writing the last overlap).
    grads: this rank's fp32 gradient shards between backward and the optimizer step: "auto" (default:
        with the optimizer's tier, so device or CPU; with the optimizer on NVMe in host memory where they fit,
        else on NVMe: [Note: gradients on the host] in zinf/placement.py), "cpu", or "nvme" (needs optimizer
        "nvme").
        On NVMe each group's shard is written as soon as its gradient is complete during backward,
        and the optimizer reads it with the states of the same sub-group.
    nvme_paths: one or more directories (one per drive, no RAID needed); each rank's shards are
        striped across them, in files of its own.
    pinned_pool_bytes: the fixed pool of aligned (and, with CUDA, pinned) buffers NVMe traffic is
        staged through.
    sub_group_numel: elements per optimizer sub-group (the unit of the NVMe optimizer pipeline).
    overlap_optimizer: run the offloaded optimizer step in the background, overlapped with the next
        forward pass; a group's next gather waits only for that group's update, the next backward for
        the whole step.
    optimizer_thread: where that overlapped step runs: "worker" (a thread of its own, while the next forward
        runs), "training" (the training thread, a sub-group at a time, as the next forward's gathers need the
        groups), or "auto" (the default: "training" where the host's cores compute the model, "worker" with a GPU;
        see [Note: a sweep the gathers drive] in zinf/optim/driven_sweep.py).
    step_during_backward: with the optimizer on "cpu", step each group's CPU-Adam during the backward, as soon
        as its gradient shard is complete on the host (speculatively: the step after the backward keeps it where
        clipping, loss scaling, later micro-batches and the hyper-parameters left it unchanged, and rolls it back
        and redoes it otherwise, so the result is the same bit for bit). Costs 12 bytes of host memory per
        parameter (the rollback copies); see [Note: steps during the backward] in zinf/optim/early_steps.py.
    max_cpu_bytes: the most host memory zinf may use for offloaded state (0: what the machine has
        available); a placement that cannot fit fails before training starts.
    frozen_in_place: with params "nvme", frozen parameters loaded under ``zinf.Init`` from safetensors files that
        hold them at the storage width (a bf16 LoRA base into bf16) are read from those files where they lie,
        never copied to the swap files: loading writes nothing for them and the drive holds the model once. The
        files are never written; a file changed under a run is an error. See [Note: frozen shards in place] in
        zinf/offload/in_place.py.
    optimizer_device_fraction: with the optimizer on "cpu" or "nvme" and the parameters on "device", the share of
        the trained parameters (whole groups, the first built) whose fp32 master and moments stay on the compute
        device and are stepped there, while the CPU-Adam sweeps the rest: 0 (the default) steps everything on the
        CPU. See [Note: the device share] in zinf/offload/device_states.py.
    frozen_reads: how the frozen groups read in place reach every rank: "gathered" (the default: each rank reads its
        own shard; they are all-gathered) or "whole" (where every rank runs on one host and sees the same files,
        each rank reads every rank's shard and gathers the group without a collective: world times the disk bytes;
        see [Note: frozen groups read whole] in zinf/offload/whole_reads.py, measured in docs/pretrained.md).
    aio_bytes_per_s: a cap on the bytes per second the engine's offload reads and writes move together (0, the default:
        none; loading under ``zinf.Init`` is not capped),
        to leave a shared drive's bandwidth to other work or to see how a run would go on a slower drive; ``zinf info
        --nvme`` and the step report's ``nvme_floor`` measure the capped speed when given the same cap.
    """

    params: str = "device"
    optimizer: str = "device"
    grads: str = "auto"
    nvme_paths: list[str] = field(default_factory=list)
    pinned_pool_bytes: int = 256 * 2**20
    sub_group_numel: int = 32 * 2**20
    overlap_optimizer: bool = True
    optimizer_thread: str = "auto"
    step_during_backward: bool = False
    max_cpu_bytes: int = 0
    frozen_in_place: bool = True
    aio_block_bytes: int = 1 << 20
    aio_queue_depth: int = 32
    aio_threads: int = 2
    aio_bytes_per_s: int = 0
    optimizer_device_fraction: float = 0.0
    frozen_reads: str = "gathered"

    def validate(self) -> None:
        check_types(self, "offload.")
        require(self.params in TIERS, "offload.params", self.params, f"one of {list(TIERS)}")
        require(self.optimizer in TIERS, "offload.optimizer", self.optimizer, f"one of {list(TIERS)}")
        require(self.grads in ("auto", "cpu", "nvme"), "offload.grads", self.grads, "one of ['auto', 'cpu', 'nvme']")
        require(self.grads != "nvme" or self.optimizer == "nvme", "offload.grads", self.grads,
                 "'nvme' only with offload.optimizer='nvme' (the NVMe optimizer pipeline reads them); use 'auto'")
        require(self.grads != "cpu" or self.optimizer != "device", "offload.grads", self.grads,
                 "'cpu' only with an offloaded optimizer (offload.optimizer 'cpu' or 'nvme'); use 'auto'")
        require(self.optimizer_thread in ("auto", "worker", "training"), "offload.optimizer_thread",
                self.optimizer_thread, "one of ['auto', 'worker', 'training']")
        require(not self.step_during_backward or self.optimizer == "cpu", "offload.step_during_backward",
                 self.step_during_backward, "False unless offload.optimizer='cpu' (it steps the states in host memory)")
        uses_nvme = "nvme" in (self.params, self.optimizer)
        require(not uses_nvme or bool(self.nvme_paths), "offload.nvme_paths", list(self.nvme_paths),
                 "at least one directory when offload.params or offload.optimizer is 'nvme'")
        require(all(self.nvme_paths), "offload.nvme_paths", self.nvme_paths, "a list of directory paths (no empty ones)")
        require(self.pinned_pool_bytes >= 1 << 20, "offload.pinned_pool_bytes", self.pinned_pool_bytes,
                 f"at least {format_bytes(1 << 20)} ({1 << 20})")
        require(self.sub_group_numel >= 1024, "offload.sub_group_numel", self.sub_group_numel, "at least 1024")
        require(self.max_cpu_bytes >= 0, "offload.max_cpu_bytes", self.max_cpu_bytes, "an integer >= 0 (0 = available RAM)")
        for key in ("aio_block_bytes", "aio_queue_depth", "aio_threads"):
            require(getattr(self, key) >= 1, f"offload.{key}", getattr(self, key), "a positive integer")
        require(0.0 <= self.optimizer_device_fraction < 1.0, "offload.optimizer_device_fraction",
                 self.optimizer_device_fraction, "a number in [0, 1) (0: every group's optimizer state off the device)")
        require(self.optimizer_device_fraction == 0 or (self.optimizer != "device" and self.params == "device"),
                 "offload.optimizer_device_fraction", self.optimizer_device_fraction,
                 "0 unless offload.optimizer is 'cpu' or 'nvme' and offload.params is 'device' (the share's shards stay "
                 "on the device it steps them on)")
        require(self.frozen_reads in ("gathered", "whole"), "offload.frozen_reads", self.frozen_reads,
                 "one of ['gathered', 'whole']")
        require(self.aio_bytes_per_s >= 0, "offload.aio_bytes_per_s", self.aio_bytes_per_s,
                 "an integer >= 0 (0: no cap on the offload's disk traffic)")
        require(self.aio_block_bytes % 4096 == 0, "offload.aio_block_bytes", self.aio_block_bytes, "a multiple of 4096")

    @property
    def enabled(self) -> bool:
        return self.params != "device" or self.optimizer != "device"

    @property
    def grads_tier(self) -> str:
        """Where gradient shards wait for the optimizer: "device", "cpu" or "nvme"; with ``grads: auto`` and the
        optimizer on NVMe, "nvme" here, which the placement may change to "cpu" (``Placement.grads_tier``)."""
        return self.optimizer if self.grads == "auto" else self.grads


@dataclass(kw_only=True)
class TilingConfig(Checked):
    """Memory-centric tiling (see zinf/tiling.py): every ``nn.Linear`` whose weight has at least
    ``min_numel`` elements (0: tiling off) becomes a :class:`zinf.TiledLinear` with the same weights, whose
    tiles are gathered one at a time. The tile grid is ``tiles`` = [input splits, output splits] when
    given, else the fewest tiles whose largest weight tile holds at most ``max_tile_bytes`` (in the
    compute dtype). ``frozen_tile_bytes`` (0: off): frozen ``nn.Linear`` layers stored in 16 bits and computed in fp32
    on a CPU are gathered at their storage width and multiplied a tile of about this many bytes of widened weight at
    a time (4 MiB: 4194304), see [Note: frozen linears from storage] in zinf/frozen_linear.py."""

    min_numel: int = 0
    max_tile_bytes: int = 0
    tiles: list[int] = field(default_factory=list)
    frozen_tile_bytes: int = 0

    def validate(self) -> None:
        check_types(self, "tiling.")
        require(self.min_numel >= 0, "tiling.min_numel", self.min_numel, "an integer >= 0 (0 turns tiling off)")
        require(self.max_tile_bytes >= 0, "tiling.max_tile_bytes", self.max_tile_bytes, "an integer >= 0")
        require(self.frozen_tile_bytes >= 0, "tiling.frozen_tile_bytes", self.frozen_tile_bytes,
                "an integer >= 0 (0: frozen layers widened whole; 4194304: 4 MiB tiles)")
        require(len(self.tiles) in (0, 2) and all(t >= 1 for t in self.tiles), "tiling.tiles", self.tiles,
                 "[input splits, output splits], two integers >= 1 (or [] to size tiles by max_tile_bytes)")
        require(not self.enabled or bool(self.tiles) or self.max_tile_bytes > 0, "tiling.min_numel", self.min_numel,
                 "0 unless tiling.tiles or tiling.max_tile_bytes says how to split (set one of them)")

    @property
    def enabled(self) -> bool:
        return self.min_numel > 0


@dataclass(kw_only=True)
class CheckpointingConfig(Checked):
    """Activation checkpointing (see zinf/recompute.py): every module whose class name or qualified
    name pattern (``fnmatch``) is in ``modules`` keeps only its inputs from forward to backward and runs
    again during backward (its parameters gathered again through zinf's hooks). ``offload`` keeps those
    inputs in host memory (pinned, copied on a side stream with CUDA) instead of on the device."""

    modules: list[str] = field(default_factory=list)
    offload: bool = False

    def validate(self) -> None:
        check_types(self, "activation_checkpointing.")
        require(all(self.modules), "activation_checkpointing.modules", self.modules,
                 "a list of block class names or module name patterns, e.g. ['Block'] or ['blocks.*'] (no empty ones)")


@dataclass(kw_only=True)
class CheckpointConfig(Checked):
    """Reading sharded checkpoints (see docs/checkpoints.md, "What a checkpoint may contain").

    allow_pickle: False (default): a checkpoint is read as data only; its client state loads with torch's
        ``weights_only`` rules plus the types the front ends store, and anything else is refused, as is a
        checkpoint of the earlier, pickled format. True says "I trust every checkpoint this run loads": the
        client state may hold any Python object and earlier checkpoints load, which runs their pickles (and any
        code a pickle names)."""

    allow_pickle: bool = False

    def validate(self) -> None:
        check_types(self, "checkpoint.")
