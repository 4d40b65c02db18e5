"""One typed configuration for the engine.

Plain dataclasses (``kw_only``) so that OmegaConf/Hydra can build them as structured configs, and
``ZeroConfig.from_dict`` for dicts, YAML and ``DictConfig`` objects. A key that does not exist, a value
of the wrong type (see [Note: config types] in zinf/config_types.py) or a value outside its allowed set is
a :class:`~zinf.errors.ConfigError` naming the key, the value, the allowed values and the closest valid
key; every config checks itself when it is built, whichever way it is built.

``ZeroConfig`` is defined here; its sections (``overlap``, ``offload``, ...) in zinf/config_sections.py and the
building from mappings in zinf/config_build.py, all importable from this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from zinf.config_build import Checked, build_config, build_from_mapping, require, to_plain_dict
from zinf.config_sections import (TIERS, CheckpointConfig, CheckpointingConfig, LossScaleConfig, OffloadConfig,
                                  OverlapConfig, TilingConfig)
from zinf.config_types import check_types, sections
from zinf.errors import ConfigError

__all__ = ["ZeroConfig", "LossScaleConfig", "OverlapConfig", "OffloadConfig", "TilingConfig", "CheckpointingConfig",
           "CheckpointConfig",
           "PRECISIONS", "TIERS", "load_config_file", "build_config"]

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_REDUCE_DTYPES = ("fp32", "param")
OPTIMIZER_STORAGES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}  # int8: uint8 codes
_DIVERGENCE = ("auto", "error")
_UNIT_POLICIES = ("blocks", "modules")


@dataclass(kw_only=True)
class ZeroConfig(Checked):
    """Everything the engine needs to know.

    precision: compute dtype of gathered parameters and activations ("fp32", "bf16", "fp16");
        optimizer master weights and gradient shards are always fp32.
    param_storage: dtype of the parameter shards at rest, on every tier (device, CPU, NVMe): "precision"
        (default: the compute dtype), or "bf16" / "fp16" with fp32 compute: half the bytes kept, read from
        NVMe and all-gathered, widened to fp32 after the all-gather; the fp32 masters stay with the
        optimizer. For CPUs without bf16 units (fp32 compute is far faster there) and NVMe-bound runs.
        The masters are stepped in fp32 and rounded to this dtype after each step (mixed precision).
    optimizer_storage: how the offloaded CPU-Adam keeps its moments (``offload.optimizer`` "cpu" or "nvme"): "fp32"
        (default, exact against torch's Adam); "bf16": half the moments' bytes in host memory, on NVMe and through
        the CPU-Adam's pass (12 bytes per parameter instead of 16 with parameters and optimizer on the CPU); "int8":
        a byte per moment and a power-of-two scale per 256 elements (10.01 bytes per parameter). The fp32 master
        stays; the moments are decoded, stepped in fp32 and rounded back stochastically, which keeps their expected
        values (see [Note: bf16 moments] in cpp/adam/kernel_scalar_body.h, [Note: int8 moments] in
        cpp/adam/int8_moments.h). A checkpoint holds the moments' values in fp32, exactly (int8 ones decoded);
        loading it into an engine of another storage converts them.
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
        stops with an error naming the rank that stopped answering, where torch allows it (0 = the process group's
        own timeout).
    trim_heap_bytes: where host memory is short during training on the CPU with the parameters offloaded
        (``offload.params`` "cpu" or "nvme", and ``offload.max_cpu_bytes`` set or this host's ranks gathering models
        larger than a quarter of the memory their placements leave free), gathered parameters and gradients freed to
        glibc's heap, which keeps what they free and fragments, are handed back (``malloc_trim``) after every this
        many bytes of them, and glibc's mmap threshold is fixed at 1 MiB for the process; both cost step time in
        page faults (measured: docs/offload.md, "Overlap: NVMe step against the in-memory step" and "Host memory of
        a Trainer full fine-tune"). 0 turns both off. See [Note: heap growth] in zinf/heap.py.
    """

    precision: str = "fp32"
    param_storage: str = "precision"
    optimizer_storage: str = "fp32"
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
                setattr(self, name, build_from_mapping(section, to_plain_dict(value), prefix=f"{name}."))
        self.validate()

    def validate(self) -> None:
        check_types(self, "")
        require(self.precision in PRECISIONS, "precision", self.precision, f"one of {sorted(PRECISIONS)}")
        require(self.param_storage in ("precision", *PRECISIONS), "param_storage", self.param_storage,
                 f"one of {['precision', *sorted(PRECISIONS)]}")
        require(self.param_storage in ("precision", self.precision) or self.precision == "fp32", "param_storage",
                 self.param_storage, f"'precision' or '{self.precision}' with precision='{self.precision}' (a 16-bit "
                 "storage dtype is for fp32 compute; with 16-bit compute the shards are already 16-bit)")
        require(self.optimizer_storage in OPTIMIZER_STORAGES, "optimizer_storage", self.optimizer_storage,
                 f"one of {list(OPTIMIZER_STORAGES)}")
        require(self.optimizer_storage == "fp32" or self.offload.optimizer != "device", "optimizer_storage",
                 self.optimizer_storage, "'fp32' with offload.optimizer: device (compact moments are the offloaded "
                 "CPU-Adam's: set offload.optimizer to 'cpu' or 'nvme')")
        require(self.reduce_dtype in _REDUCE_DTYPES, "reduce_dtype", self.reduce_dtype, f"one of {list(_REDUCE_DTYPES)}")
        require(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping, "a number >= 0 (0 turns clipping off)")
        require(self.trim_heap_bytes >= 0, "trim_heap_bytes", self.trim_heap_bytes, "an integer >= 0 (0 turns it off)")
        require(self.log_every_n_steps >= 0, "log_every_n_steps", self.log_every_n_steps, "an integer >= 0")
        require(self.collective_timeout_s >= 0, "collective_timeout_s", self.collective_timeout_s,
                 "a number of seconds >= 0 (0 = torch's default timeout)")
        require(all(self.unit_modules), "unit_modules", self.unit_modules,
                 "a list of module name patterns or class names, e.g. ['model.layers.*.mlp'] (no empty ones)")
        require(self.unit_policy in _UNIT_POLICIES, "unit_policy", self.unit_policy,
                 f"one of {list(_UNIT_POLICIES)} ('blocks': each repeated block gathered as one unit; 'modules': every "
                 "module on its own)")
        require(self.divergence in _DIVERGENCE, "divergence", self.divergence, f"one of {list(_DIVERGENCE)}")
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
    def moment_dtype(self) -> torch.dtype:
        """The offloaded CPU-Adam's moments' dtype (``optimizer_storage``)."""
        return OPTIMIZER_STORAGES[self.optimizer_storage]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return torch.float32 if self.reduce_dtype == "fp32" else self.compute_dtype

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, **overrides: Any) -> "ZeroConfig":
        """Build from a (possibly nested) mapping: a dict, a parsed YAML/JSON file or an OmegaConf DictConfig."""
        data = to_plain_dict(values) if values is not None else {}
        data.update(overrides)
        return build_from_mapping(cls, data, prefix="")

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
