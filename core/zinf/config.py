"""One typed configuration for the engine.

Plain dataclasses (``kw_only``) so that OmegaConf/Hydra can build them as structured configs, and
``ZeroConfig.from_dict`` for dicts, YAML and ``DictConfig`` objects. A key that does not exist, a value
of the wrong type (see [Note: config types] in zinf/config_types.py) or a value outside its allowed set is
a :class:`~zinf.errors.ConfigError` naming the key, the value, the allowed values and the closest valid
key; every config checks itself when it is built, whichever way it is built.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from zinf.config_types import check_types, sections
from zinf.errors import ConfigError
from zinf.units import format_bytes

__all__ = ["ZeroConfig", "LossScaleConfig", "OverlapConfig", "OffloadConfig", "TilingConfig", "CheckpointingConfig",
           "CheckpointConfig",
           "PRECISIONS", "TIERS", "load_config_file", "build_config"]

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_REDUCE_DTYPES = ("fp32", "param")
_DIVERGENCE = ("auto", "error")
_UNIT_POLICIES = ("blocks", "modules")
TIERS = ("device", "cpu", "nvme")
RESHARD_AFTER_FORWARD = ("auto", "always", "never")  # overlap.reshard_after_forward (zinf plan takes the same)


class _Checked:
    """Base of the config dataclasses: each validates itself when constructed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        raise NotImplementedError


@dataclass(kw_only=True)
class LossScaleConfig(_Checked):
    """Dynamic loss scaling for ``precision="fp16"`` (ignored otherwise)."""

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def validate(self) -> None:
        check_types(self, "loss_scale.")
        _require(self.initial_scale > 0, "loss_scale.initial_scale", self.initial_scale, "a positive number")
        _require(self.growth_factor > 1, "loss_scale.growth_factor", self.growth_factor, "a number > 1")
        _require(0 < self.backoff_factor < 1, "loss_scale.backoff_factor", self.backoff_factor, "a number in (0, 1)")
        _require(self.growth_interval >= 1, "loss_scale.growth_interval", self.growth_interval, "an integer >= 1")
        _require(self.min_scale > 0, "loss_scale.min_scale", self.min_scale, "a positive number")


@dataclass(kw_only=True)
class OverlapConfig(_Checked):
    """How far ahead parameters are gathered and how gradients are bucketed.

    ``prefetch_bytes`` bounds the bytes of gathered-ahead parameters (0 turns prefetch off);
    ``persistent_numel`` keeps modules whose own parameters are smaller than this gathered for the
    whole run; gradients are reduce-scattered in buckets of about ``reduce_bucket_bytes`` (small
    groups coalesced into one collective), at most two buckets in flight; 0 (default) sizes them by the
    backend: 4 MiB with gloo, where the last bucket's reduce is the wait at the end of the backward and smaller
    buckets shorten it until each collective's fixed cost dominates; 16 MiB with NCCL, where each collective
    costs a launch (measured: docs/benchmarks.md, "Measurements behind the defaults"). ``max_gathered_bytes`` (0: no
    limit) caps the bytes of full parameters gathered at once, prefetched ones included: prefetch stays
    under it, and a module that alone needs more is an error that names it (tile it: ``tiling``).
    ``coalesce_gathers`` ("auto", "on", "off") issues the gathers every rank agreed on in one round as one
    collective per dtype (see [Note: one collective per round] in zinf/runtime/gather_batch.py) instead of one
    all-gather per group. "auto" (default) and "on": coalesced on every backend (with NCCL one grouped launch
    for a whole block, as FSDP2 issues one all-gather per block); "off": one all-gather per group.
    ``reshard_after_forward`` says which groups go back to their shards after their module's forward (see
    [Note: kept for backward] in zinf/schedule/keep.py): "auto" (default) all but the ones the backward gathers
    first, as many as fit ``prefetch_bytes`` (and half of ``max_gathered_bytes``), which stay gathered from their
    last use in the forward into their backward, and, whatever their size, those of the modules the backward starts
    with where the forward ends with them (the output layer, the root); "always" every group (ZeRO-3 as DeepSpeed
    runs it: the backward gathers everything again); "never" none that the backward gathers, as FSDP2's ``reshard_after_forward=False``:
    one all-gather per parameter a step instead of two, for the memory of the whole model's parameters gathered
    at the end of the forward (under ``max_gathered_bytes`` only what fits it).
    ``shared_memory`` ("auto", "off"): with "auto" (default), gloo ranks that compute on the CPU of one host
    all-gather parameters and reduce-scatter gradients through shared memory (``/dev/shm``) instead of gloo's
    sockets, 16 MiB of it per rank (see [Note: same-host collectives] in zinf/shared_memory.py); "off": always
    through the process group.
    """

    prefetch_bytes: int = 64 * 2**20
    prefetch_modules: int = 4
    persistent_numel: int = 0
    reduce_bucket_bytes: int = 0
    max_gathered_bytes: int = 0
    coalesce_gathers: str = "auto"
    reshard_after_forward: str = "auto"
    shared_memory: str = "auto"

    def validate(self) -> None:
        check_types(self, "overlap.")
        _require(self.prefetch_bytes >= 0, "overlap.prefetch_bytes", self.prefetch_bytes, "an integer >= 0")
        _require(self.max_gathered_bytes >= 0, "overlap.max_gathered_bytes", self.max_gathered_bytes,
                 "an integer >= 0 (0 = no limit)")
        _require(self.prefetch_modules >= 0, "overlap.prefetch_modules", self.prefetch_modules, "an integer >= 0")
        _require(self.persistent_numel >= 0, "overlap.persistent_numel", self.persistent_numel, "an integer >= 0")
        _require(self.coalesce_gathers in ("auto", "on", "off"), "overlap.coalesce_gathers", self.coalesce_gathers,
                 "one of ['auto', 'on', 'off'] ('off': one all-gather per group)")
        _require(self.reshard_after_forward in RESHARD_AFTER_FORWARD, "overlap.reshard_after_forward",
                 self.reshard_after_forward, f"one of {list(RESHARD_AFTER_FORWARD)} ('never': keep every group "
                 "gathered from its forward to its backward)")
        _require(self.shared_memory in ("auto", "off"), "overlap.shared_memory", self.shared_memory,
                 "one of ['auto', 'off'] ('off': every collective through the process group)")
        _require(self.reduce_bucket_bytes >= 0, "overlap.reduce_bucket_bytes", self.reduce_bucket_bytes,
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
class OffloadConfig(_Checked):
    """Where each kind of state lives between uses (ZeRO-Infinity's offload engine).

    params: this rank's compute-dtype parameter shards: "device" (default), "cpu" or "nvme".
    optimizer: fp32 master shards and Adam moments: "device" (the user's torch optimizer steps them
        in place), "cpu" or "nvme" (zinf's C++ CPU-Adam steps them, sub-group by sub-group; with
        "nvme" reading the next sub-group, stepping this one and writing the last overlap).
    grads: this rank's fp32 gradient shards between backward and the optimizer step: "auto" (default:
        with the optimizer's tier, so device, CPU or NVMe), "cpu", or "nvme" (needs optimizer "nvme").
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
    """

    params: str = "device"
    optimizer: str = "device"
    grads: str = "auto"
    nvme_paths: list[str] = field(default_factory=list)
    pinned_pool_bytes: int = 256 * 2**20
    sub_group_numel: int = 32 * 2**20
    overlap_optimizer: bool = True
    step_during_backward: bool = False
    max_cpu_bytes: int = 0
    frozen_in_place: bool = True
    aio_block_bytes: int = 1 << 20
    aio_queue_depth: int = 32
    aio_threads: int = 2

    def validate(self) -> None:
        check_types(self, "offload.")
        _require(self.params in TIERS, "offload.params", self.params, f"one of {list(TIERS)}")
        _require(self.optimizer in TIERS, "offload.optimizer", self.optimizer, f"one of {list(TIERS)}")
        _require(self.grads in ("auto", "cpu", "nvme"), "offload.grads", self.grads, "one of ['auto', 'cpu', 'nvme']")
        _require(self.grads != "nvme" or self.optimizer == "nvme", "offload.grads", self.grads,
                 "'nvme' only with offload.optimizer='nvme' (the NVMe optimizer pipeline reads them); use 'auto'")
        _require(self.grads != "cpu" or self.optimizer != "device", "offload.grads", self.grads,
                 "'cpu' only with an offloaded optimizer (offload.optimizer 'cpu' or 'nvme'); use 'auto'")
        _require(not self.step_during_backward or self.optimizer == "cpu", "offload.step_during_backward",
                 self.step_during_backward, "False unless offload.optimizer='cpu' (it steps the states in host memory)")
        uses_nvme = "nvme" in (self.params, self.optimizer)
        _require(not uses_nvme or bool(self.nvme_paths), "offload.nvme_paths", list(self.nvme_paths),
                 "at least one directory when offload.params or offload.optimizer is 'nvme'")
        _require(all(self.nvme_paths), "offload.nvme_paths", self.nvme_paths, "a list of directory paths (no empty ones)")
        _require(self.pinned_pool_bytes >= 1 << 20, "offload.pinned_pool_bytes", self.pinned_pool_bytes,
                 f"at least {format_bytes(1 << 20)} ({1 << 20})")
        _require(self.sub_group_numel >= 1024, "offload.sub_group_numel", self.sub_group_numel, "at least 1024")
        _require(self.max_cpu_bytes >= 0, "offload.max_cpu_bytes", self.max_cpu_bytes, "an integer >= 0 (0 = available RAM)")
        for key in ("aio_block_bytes", "aio_queue_depth", "aio_threads"):
            _require(getattr(self, key) >= 1, f"offload.{key}", getattr(self, key), "a positive integer")
        _require(self.aio_block_bytes % 4096 == 0, "offload.aio_block_bytes", self.aio_block_bytes, "a multiple of 4096")

    @property
    def enabled(self) -> bool:
        return self.params != "device" or self.optimizer != "device"

    @property
    def grads_tier(self) -> str:
        """Where gradient shards wait for the optimizer: "device", "cpu" or "nvme"."""
        return self.optimizer if self.grads == "auto" else self.grads


@dataclass(kw_only=True)
class TilingConfig(_Checked):
    """Memory-centric tiling (see zinf/tiling.py): every ``nn.Linear`` whose weight has at least
    ``min_numel`` elements (0: tiling off) becomes a :class:`zinf.TiledLinear` with the same weights, whose
    tiles are gathered one at a time. The tile grid is ``tiles`` = [input splits, output splits] when
    given, else the fewest tiles whose largest weight tile holds at most ``max_tile_bytes`` (in the
    compute dtype)."""

    min_numel: int = 0
    max_tile_bytes: int = 0
    tiles: list[int] = field(default_factory=list)

    def validate(self) -> None:
        check_types(self, "tiling.")
        _require(self.min_numel >= 0, "tiling.min_numel", self.min_numel, "an integer >= 0 (0 turns tiling off)")
        _require(self.max_tile_bytes >= 0, "tiling.max_tile_bytes", self.max_tile_bytes, "an integer >= 0")
        _require(len(self.tiles) in (0, 2) and all(t >= 1 for t in self.tiles), "tiling.tiles", self.tiles,
                 "[input splits, output splits], two integers >= 1 (or [] to size tiles by max_tile_bytes)")
        _require(not self.enabled or bool(self.tiles) or self.max_tile_bytes > 0, "tiling.min_numel", self.min_numel,
                 "0 unless tiling.tiles or tiling.max_tile_bytes says how to split (set one of them)")

    @property
    def enabled(self) -> bool:
        return self.min_numel > 0


@dataclass(kw_only=True)
class CheckpointingConfig(_Checked):
    """Activation checkpointing (see zinf/recompute.py): every module whose class name or qualified
    name pattern (``fnmatch``) is in ``modules`` keeps only its inputs from forward to backward and runs
    again during backward (its parameters gathered again through zinf's hooks). ``offload`` keeps those
    inputs in host memory (pinned, copied on a side stream with CUDA) instead of on the device."""

    modules: list[str] = field(default_factory=list)
    offload: bool = False

    def validate(self) -> None:
        check_types(self, "activation_checkpointing.")
        _require(all(self.modules), "activation_checkpointing.modules", self.modules,
                 "a list of block class names or module name patterns, e.g. ['Block'] or ['blocks.*'] (no empty ones)")


@dataclass(kw_only=True)
class CheckpointConfig(_Checked):
    """Reading sharded checkpoints (see docs/checkpoints.md, "What a checkpoint may contain").

    allow_pickle: False (default): a checkpoint is read as data only; its client state loads with torch's
        ``weights_only`` rules plus the types the front ends store, and anything else is refused, as is a
        checkpoint of the earlier, pickled format. True says "I trust every checkpoint this run loads": the
        client state may hold any Python object and earlier checkpoints load, which runs their pickles (and any
        code a pickle names)."""

    allow_pickle: bool = False

    def validate(self) -> None:
        check_types(self, "checkpoint.")


@dataclass(kw_only=True)
class ZeroConfig(_Checked):
    """Everything the engine needs to know.

    precision: compute dtype of gathered parameters and activations ("fp32", "bf16", "fp16");
        optimizer master weights and gradient shards are always fp32.
    param_storage: dtype of the parameter shards at rest, on every tier (device, CPU, NVMe): "precision"
        (default: the compute dtype), or "bf16" / "fp16" with fp32 compute: half the bytes kept, read from
        NVMe and all-gathered, widened to fp32 after the all-gather; the fp32 masters stay with the
        optimizer. For CPUs without bf16 units (fp32 compute is far faster there) and NVMe-bound runs.
        The masters are stepped in fp32 and rounded to this dtype after each step (mixed precision).
    reduce_dtype: dtype of the gradient reduce-scatter: "fp32" (default, exact) or "param".
    gradient_clipping: clip the global gradient norm to this value (0 = off).
    detect_external_params: watch tensor operations during forward so that a parameter used outside
        the module that owns it (tied weights, a parent reading a child's weight) is gathered on demand.
    unit_modules: modules gathered (and reduced) as one unit, their whole subtree at once: qualified
        name patterns (``fnmatch``, e.g. ``"model.layers.*.mlp"``) or class names (``"MixtralSparseMoeBlock"``).
        For blocks whose submodules run differently on each rank (mixture-of-experts routing).
    unit_policy: which modules are gathered as one unit besides ``unit_modules``: "blocks" (default) gathers
        each of the model's repeated blocks as one unit, as FSDP2 users wrap each block: the classes a
        transformers model names in ``_no_split_modules`` (``GPT2Block``, ``LlamaDecoderLayer``), or else the
        modules of an ``nn.ModuleList`` / ``nn.Sequential`` that are all of one class and hold parameters in
        more than one submodule. A block that contains a tiled layer (``tiling``), or that alone needs more
        than ``overlap.max_gathered_bytes``, stays gathered module by module. "modules" gathers every module on
        its own (the smallest working memory; one gather per module). See [Note: blocks as units] in
        zinf/schedule/units.py.
    divergence: what happens when ranks' control flow differs so that they need different gathers:
        "auto" (default) serves every rank's gathers, so training stays exact, and gathers the nearest
        module every rank calls as one unit from then on (logged); "error" raises a
        CollectiveMismatchError on every rank that names the modules (no hang, no wrong step).
    broadcast_buffers: module buffers (BatchNorm running statistics, counters) as DDP's default keeps them
        (its argument of the same name): rank 0's are broadcast to every rank when the engine is built and at
        the start of a forward that follows a grad-enabled forward (so the first eval forward after training
        sees rank 0's statistics on every rank, and a full state dict holds rank 0's); False keeps each
        rank's own, updated by its own batches only. See [Note: buffers like DDP] in zinf/schedule/buffers.py.
    collective_timeout_s: how long a collective may wait for the other ranks, in seconds, before the run
        stops with an error naming the rank that stopped answering, where torch allows it (0 = torch's
        default timeout).
    trim_heap_bytes: with the compute device the CPU and the parameters offloaded (``offload.params`` "cpu" or
        "nvme": host memory is what the run is short of), gathered parameters and gradients are freed to glibc's
        heap, which keeps what they free and fragments; zinf hands the heap's free pages back (``malloc_trim``)
        after every this many bytes of them freed, during the step, which costs step time in page faults
        (both measured: docs/offload.md, "Host memory of a Trainer full fine-tune"). 0 turns it off. See
        [Note: heap growth] in zinf/heap.py.
    """

    precision: str = "fp32"
    param_storage: str = "precision"
    reduce_dtype: str = "fp32"
    gradient_clipping: float = 0.0
    detect_external_params: bool = True
    cast_forward_inputs: bool = True
    unit_modules: list[str] = field(default_factory=list)
    unit_policy: str = "blocks"
    divergence: str = "auto"
    broadcast_buffers: bool = True
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tiling: TilingConfig = field(default_factory=TilingConfig)
    activation_checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log_every_n_steps: int = 0
    collective_timeout_s: float = 0.0
    trim_heap_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name, section in sections(ZeroConfig).items():  # ZeroConfig(offload={...}) as from_dict would
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _build(section, _to_plain_dict(value), prefix=f"{name}."))
        self.validate()

    def validate(self) -> None:
        check_types(self, "")
        _require(self.precision in PRECISIONS, "precision", self.precision, f"one of {sorted(PRECISIONS)}")
        _require(self.param_storage in ("precision", *PRECISIONS), "param_storage", self.param_storage,
                 f"one of {['precision', *sorted(PRECISIONS)]}")
        _require(self.param_storage in ("precision", self.precision) or self.precision == "fp32", "param_storage",
                 self.param_storage, f"'precision' or '{self.precision}' with precision='{self.precision}' (a 16-bit "
                 "storage dtype is for fp32 compute; with 16-bit compute the shards are already 16-bit)")
        _require(self.reduce_dtype in _REDUCE_DTYPES, "reduce_dtype", self.reduce_dtype, f"one of {list(_REDUCE_DTYPES)}")
        _require(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping, "a number >= 0 (0 turns clipping off)")
        _require(self.trim_heap_bytes >= 0, "trim_heap_bytes", self.trim_heap_bytes, "an integer >= 0 (0 turns it off)")
        _require(self.log_every_n_steps >= 0, "log_every_n_steps", self.log_every_n_steps, "an integer >= 0")
        _require(self.collective_timeout_s >= 0, "collective_timeout_s", self.collective_timeout_s,
                 "a number of seconds >= 0 (0 = torch's default timeout)")
        _require(all(self.unit_modules), "unit_modules", self.unit_modules,
                 "a list of module name patterns or class names, e.g. ['model.layers.*.mlp'] (no empty ones)")
        _require(self.unit_policy in _UNIT_POLICIES, "unit_policy", self.unit_policy,
                 f"one of {list(_UNIT_POLICIES)} ('blocks': each repeated block gathered as one unit; 'modules': every "
                 "module on its own)")
        _require(self.divergence in _DIVERGENCE, "divergence", self.divergence, f"one of {list(_DIVERGENCE)}")
        self.loss_scale.validate()
        self.overlap.validate()
        self.offload.validate()
        self.tiling.validate()
        self.activation_checkpointing.validate()
        self.checkpoint.validate()

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The parameter shards' dtype at rest (``param_storage``)."""
        return self.compute_dtype if self.param_storage == "precision" else PRECISIONS[self.param_storage]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.reduce_dtype == "fp32" else self.compute_dtype

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, **overrides: Any) -> "ZeroConfig":
        """Build from a (possibly nested) mapping: a dict, a parsed YAML/JSON file or an OmegaConf DictConfig."""
        data = _to_plain_dict(values) if values is not None else {}
        data.update(overrides)
        return _build(cls, data, prefix="")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config_file(path: str, section: str = "zinf") -> ZeroConfig:
    """The engine config in a YAML (or JSON) file: either the file is an engine config, or it is a larger
    file (an experiment or launcher config) whose ``section`` key holds one."""
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except FileNotFoundError:
        raise ConfigError(f"zinf config: the file {path!r} does not exist; fix the path (or unset the variable naming it).") from None
    except Exception as exc:  # noqa: BLE001 - a YAML syntax error, named with its file
        raise ConfigError(f"zinf config: {path!r} is not a readable YAML file ({exc}).") from exc
    if data is None:
        return ZeroConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"zinf config: {path!r} must hold a mapping of settings, found {type(data).__name__}.")
    if section in data:
        data = data[section] or {}
    return ZeroConfig.from_dict(data)


def _to_plain_dict(values: Any) -> dict[str, Any]:
    try:  # OmegaConf is a dependency, but keep this module importable without it
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import MissingMandatoryValue

        if isinstance(values, DictConfig):
            try:
                return dict(OmegaConf.to_container(values, resolve=True, throw_on_missing=True))  # type: ignore[arg-type]
            except MissingMandatoryValue as exc:  # a ??? left unset, e.g. the nvme preset's nvme_paths
                key = exc.full_key or "?"
                raise ConfigError(
                    f"zinf config: '{key}' has no value (??? in the config: the config or preset leaves it to you). "
                    f"Set it, e.g. {key}=... on the Hydra command line or in your config file.") from None
    except ImportError:  # pragma: no cover
        pass
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        return dataclasses.asdict(values)
    if not isinstance(values, Mapping):
        raise ConfigError(f"zinf config: expected a mapping of settings, found {type(values).__name__}")
    return dict(values)


def build_config(cls: type, values: Any, prefix: str = "") -> Any:
    """Build the config dataclass ``cls`` (an application's own too) from a mapping, a DictConfig or a dataclass,
    as ``ZeroConfig.from_dict`` does: an unknown key is a ConfigError naming ``prefix`` + the key and the closest
    valid one, nested config dataclasses are built the same way, and ``cls`` checks its values when constructed."""
    return _build(cls, _to_plain_dict(values), prefix)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    nested = sections(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"zinf config: unknown key '{prefix}{key}'.{hint} Valid keys here: {sorted(fields)}."
            )
        if key in nested and isinstance(value, Mapping):
            value = _build(nested[key], value, prefix=f"{prefix}{key}.")
        kwargs[key] = value  # anything else of the wrong type is refused by check_types, naming the key
    return cls(**kwargs)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"zinf config: '{key}' = {value!r} is not allowed; expected {allowed}.")
