"""Where the engine config comes from, and what of an Accelerate config zinf can honour.

Engine settings, first found wins: the ``zinf_config`` argument of :class:`accelerate_zinf.Accelerator`;
the YAML file named by the environment variable ``ZINF_CONFIG`` (an engine config, or a file with a
``zinf:`` section such as a combined launch config); the defaults.

A combined launch config is an ordinary Accelerate config file plus a ``zinf:`` section. Accelerate
itself rejects unknown top-level keys and silently drops unknown keys inside its sections, and a
config asking for DeepSpeed, FSDP or Megatron would start something other than zinf, so
:func:`check_launch_config` refuses everything zinf cannot honour before any process starts.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import zinf
from zinf.config import load_config_file
from zinf.errors import ConfigError

__all__ = [
    "ENV_CONFIG", "engine_config", "with_mixed_precision", "check_distributed_type", "check_launch_config",
    "SUPPORTED_DISTRIBUTED_TYPES",
]

log = logging.getLogger(__name__)

ENV_CONFIG = "ZINF_CONFIG"

# multi-process data parallel on one kind of device per process: what the engine partitions over
SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
                               "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU")
# sections of an Accelerate config that hand the model to another engine
_OTHER_ENGINES = {
    "deepspeed_config": "DeepSpeed", "fsdp_config": "FSDP", "megatron_lm_config": "Megatron-LM",
    "parallelism_config": "tensor/context parallelism",
}
_FLAGS = {"use_deepspeed": "DeepSpeed", "use_fsdp": "FSDP", "use_megatron_lm": "Megatron-LM"}
# Accelerate mixed_precision -> engine precision
_MIXED = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_ACCELERATE_NAME = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def engine_config(explicit: zinf.ZeroConfig | Mapping[str, Any] | str | None = None) -> zinf.ZeroConfig:
    """The engine config from the script's argument (a ZeroConfig, a mapping or a YAML path), else the file
    named by ``ZINF_CONFIG``, else the defaults."""
    env = os.environ.get(ENV_CONFIG)
    if explicit is not None:
        if env:
            log.warning("zinf: using the zinf_config passed to Accelerator(); %s=%s is ignored", ENV_CONFIG, env)
        if isinstance(explicit, zinf.ZeroConfig):
            return explicit
        if isinstance(explicit, (str, os.PathLike)):
            return load_config_file(os.fspath(explicit))
        return zinf.ZeroConfig.from_dict(explicit)
    if env:
        return load_config_file(env)
    return zinf.ZeroConfig()


def with_mixed_precision(config: zinf.ZeroConfig, mixed_precision: str) -> zinf.ZeroConfig:
    """Reconcile Accelerate's ``mixed_precision`` with ``config.precision``: a non-"no" Accelerate setting
    wins over the default fp32 config, a low-precision zinf config wins over "no"; two different explicit
    choices are an error naming both."""
    flag = str(mixed_precision)
    if flag not in _MIXED:
        raise ConfigError(
            f"zinf: mixed_precision={flag!r} is not supported by the zinf engine; use one of {sorted(_MIXED)} "
            "(bf16/fp16 gather parameters in that dtype and keep fp32 master weights).")
    wanted = _MIXED[flag]
    if wanted == config.precision or wanted == "fp32":
        return config
    if config.precision != "fp32":
        raise ConfigError(
            f"zinf: Accelerate's mixed_precision={flag!r} and the zinf config's precision={config.precision!r} "
            f"disagree. Set only one of them (e.g. mixed_precision: {_ACCELERATE_NAME[config.precision]}, or drop "
            "'precision' from the zinf section).")
    return zinf.ZeroConfig.from_dict({**config.to_dict(), "precision": wanted})


def check_distributed_type(distributed_type: str, where: str = "distributed_type") -> None:
    name = str(distributed_type).split(".")[-1]
    if name in SUPPORTED_DISTRIBUTED_TYPES:
        return
    engine = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM"}.get(name)
    what = f"hands the model to {engine}" if engine else "is not multi-process data parallel"
    raise ConfigError(
        f"zinf: {where}={name!r} {what}, which zinf cannot run. zinf partitions parameters, gradients and optimizer "
        f"states itself: use distributed_type: MULTI_GPU (on CPU with use_cpu: true) or MULTI_CPU with mpirun, "
        f"or NO for one process, and put the engine settings in the zinf: section.")


def check_launch_config(data: Mapping[str, Any], path: str) -> tuple[dict[str, Any], zinf.ZeroConfig]:
    """Split a combined launch config into (Accelerate's part, the engine config), refusing what zinf
    cannot honour. Raises :class:`zinf.ConfigError` naming the key and the fix."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"zinf launch: {path} must hold a mapping (Accelerate's keys plus a zinf: section).")
    accelerate_part = dict(data)
    section = accelerate_part.pop("zinf", None) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"zinf launch: the 'zinf' section of {path} must be a mapping of engine settings.")
    try:
        config = zinf.ZeroConfig.from_dict(section)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in the zinf: section of {path})") from None
    for key, engine in _OTHER_ENGINES.items():
        if accelerate_part.get(key):
            raise ConfigError(
                f"zinf launch: {path} has a '{key}' section, which asks Accelerate to use {engine}; zinf replaces it. "
                f"Remove '{key}' and put the engine settings in the zinf: section (offload, precision, ...).")
    for key, engine in _FLAGS.items():
        if accelerate_part.get(key):
            raise ConfigError(f"zinf launch: {path} sets {key}: true ({engine}); remove it, zinf replaces {engine}.")
    check_distributed_type(accelerate_part.get("distributed_type", "NO"), where=f"distributed_type in {path}")
    if accelerate_part.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        raise ConfigError(f"zinf launch: compute_environment={accelerate_part['compute_environment']!r} in {path}; "
                          "zinf launch starts local processes: use compute_environment: LOCAL_MACHINE.")
    with_mixed_precision(config, accelerate_part.get("mixed_precision", "no"))
    nproc = _num_processes(accelerate_part.get("num_processes"), path)
    if accelerate_part.get("num_processes") is not None:
        accelerate_part["num_processes"] = nproc  # e.g. "2" from ${oc.env:NPROC,2}, as Accelerate expects it
    if (str(accelerate_part.get("distributed_type")) == "MULTI_CPU" and nproc > 1
            and not accelerate_part.get("mpirun_config")):
        raise ConfigError(
            f"zinf launch: distributed_type: MULTI_CPU with num_processes: {nproc} in {path} starts one process "
            "unless mpirun is used. For several gloo processes on one machine use distributed_type: MULTI_GPU with "
            "use_cpu: true (zinf launch exports ACCELERATE_USE_CPU=true for you).")
    return accelerate_part, config


def _num_processes(value: Any, path: str) -> int:
    """``num_processes`` of a launch config: unset (one process) or an integer >= 1."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"zinf launch: num_processes: {value!r} in {path}; it must be an integer >= 1 (the number "
                          "of processes to start, e.g. num_processes: 2), or left out for one process.")
    return value
