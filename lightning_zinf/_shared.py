"""What the Lightning strategy and the Fabric strategy share: config and precision resolution, the
root module the engine hooks, building the engine, and the name prefix that root adds.

[Note: the step root]
The engine is given a ``StepRoot`` that holds the user's module as its only child, ``module``.
Calling the root with a method name (``"training_step"``, ``"forward"``, ...) runs that method of
the user's module inside ``engine.forward``, so inputs are cast to the compute dtype and parameters
used outside their own module (tied weights, a LightningModule's own parameters read in
``training_step``) are detected. The user's module is never called re-entrantly by the adapter,
which matters for the common ``training_step`` that calls ``self(x)``. The price is a ``module.``
prefix on every name inside the engine. ``AdapterEngine.name_prefix`` tells the engine, which removes it
wherever names leave it (``full_state_dict``, checkpoint layouts and buffers, ``zinf consolidate``, exports):
they carry the user's module's own names, and a checkpoint moves between front ends. ``strip_prefix`` removes
it from names the adapter takes from elsewhere.
"""

from __future__ import annotations

import os

import logging
from typing import Any, Mapping

import torch
from torch import nn

import zinf

__all__ = [
    "StepRoot", "AdapterEngine", "PREFIX", "resolve_config", "zinf_precision", "with_precision", "build_engine",
    "strip_prefix", "module_names", "OFFLOAD_PRESETS", "offload_preset", "NAME", "register_names",
]

log = logging.getLogger(__name__)

PREFIX = "module."

# Lightning precision flag -> engine compute dtype. "mixed" and "true" mean the same here: the engine
# computes in that dtype with fp32 master shards (there is no autocast: parameters are gathered in it).
_PRECISIONS: dict[str, str] = {
    "32-true": "fp32", "32": "fp32",
    "bf16-mixed": "bf16", "bf16-true": "bf16",
    "16-mixed": "fp16", "16-true": "fp16",
}
_LIGHTNING_NAME = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}

NAME = "zero_infinity"
OFFLOAD_PRESETS = ("zero_infinity_offload", "zero_infinity_nvme")
_DESCRIPTION = "ZeRO-Infinity (zinf): parameters, gradients and optimizer states partitioned across ranks"


class StepRoot(nn.Module):
    """The module the engine hooks; see [Note: the step root]."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, method)(*args, **kwargs)


class AdapterEngine(zinf.ZeroInfinityEngine):
    """The engine over a ``StepRoot``: names leave it without the root's prefix; see [Note: the step root]."""

    name_prefix = PREFIX


def resolve_config(config: zinf.ZeroConfig | Mapping[str, Any] | None) -> zinf.ZeroConfig:
    """The engine config from what a user passed: a ZeroConfig, a dict / DictConfig, or nothing."""
    if config is None:
        return zinf.ZeroConfig()
    if isinstance(config, zinf.ZeroConfig):
        return config
    return zinf.ZeroConfig.from_dict(config)


def zinf_precision(lightning_precision: str) -> str:
    """"bf16-mixed" -> "bf16" and so on; anything the engine cannot run is an error naming the choices."""
    flag = str(lightning_precision)
    if flag not in _PRECISIONS:
        raise ValueError(
            f"zero_infinity: precision={flag!r} is not supported. Use one of "
            f"{sorted(k for k in _PRECISIONS if '-' in k)} (mixed and true both compute in that dtype with "
            "fp32 master weights)."
        )
    return _PRECISIONS[flag]


def with_precision(config: zinf.ZeroConfig, lightning_precision: str) -> zinf.ZeroConfig:
    """Reconcile the Trainer/Fabric ``precision`` with ``config.precision``.

    A non-default Trainer precision wins over a default (fp32) config; a config that asks for a low
    precision wins over the default Trainer precision ("32-true"); two different explicit choices are
    an error.
    """
    wanted = zinf_precision(lightning_precision)
    if wanted == config.precision:
        return config
    if wanted == "fp32":
        log.info("zero_infinity: using precision %r from the zinf config", config.precision)
        return config
    if config.precision != "fp32":
        raise ValueError(
            f"zero_infinity: precision={lightning_precision!r} was passed to Lightning but the zinf config says "
            f"precision={config.precision!r}. Set only one of them (e.g. precision="
            f"{_LIGHTNING_NAME[config.precision]!r}, or drop 'precision' from the zinf config)."
        )
    return zinf.ZeroConfig.from_dict({**config.to_dict(), "precision": wanted})


def lightning_precision_name(config: zinf.ZeroConfig) -> str:
    return _LIGHTNING_NAME[config.precision]


def build_engine(module: nn.Module, optimizers: list[torch.optim.Optimizer], config: zinf.ZeroConfig,
                 device: torch.device) -> zinf.ZeroInfinityEngine:
    """One engine over ``StepRoot(module)`` with at most one optimizer built on ``module.parameters()``."""
    if len(optimizers) > 1:
        raise ValueError(
            f"zero_infinity: found {len(optimizers)} optimizers; the engine steps exactly one. Return one optimizer "
            "from configure_optimizers (use parameter groups for different hyper-parameters)."
        )
    optimizer = optimizers[0] if optimizers else None
    engine = AdapterEngine(StepRoot(module), optimizer, config, device=device)
    if optimizer is not None:
        _zero_grads_in(engine, optimizer)
    return engine


def _zero_grads_in(engine: zinf.ZeroInfinityEngine, optimizer: torch.optim.Optimizer) -> None:
    """Lightning and Fabric zero gradients through the optimizer they were given (``optimizer_zero_grad``, an
    ``optimizer_step`` override that steps every other batch, manual optimisation); the gradients live in the
    engine's shards, so that call reaches the engine too (free right after a step: the step emptied them)."""
    own = getattr(optimizer, "_zinf_own_zero_grad", None) or optimizer.zero_grad
    optimizer._zinf_own_zero_grad = own  # type: ignore[attr-defined]  # a second engine wraps the optimizer's own

    def zero_grad(set_to_none: bool = True) -> None:
        own(set_to_none)
        engine.zero_grad()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def strip_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Names recorded under the step root, as the user's module names them."""
    return {(k[len(PREFIX):] if k.startswith(PREFIX) else k): v for k, v in state.items()}


def module_names(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` under the names ``module`` gives its parameters and buffers: as it is when it already uses
    them (a Lightning checkpoint, ``convert_to_lightning_checkpoint`` output, ``engine.full_state_dict()``), else
    with the step root's prefix removed (names recorded under the root elsewhere). A module with a child named
    ``module`` keeps the names it gave."""
    own = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    own |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    if own & set(state) or not all(k.startswith(PREFIX) for k in state):
        return dict(state)
    return strip_prefix(state)


def offload_preset(name: str, config: Any) -> dict[str, Any]:
    """The engine config of an offload preset, with the user's settings (if any) on top.

    "zero_infinity_offload": parameter shards and Adam states in CPU memory. "zero_infinity_nvme": both
    on NVMe, in the directories listed in the environment variable ZINF_NVME_PATHS (os.pathsep-separated).
    """
    offload: dict[str, Any] = {"params": "cpu", "optimizer": "cpu"}
    if name == "zero_infinity_nvme":
        paths = [p for p in os.environ.get("ZINF_NVME_PATHS", "").split(os.pathsep) if p]
        if not paths:
            raise ValueError(
                f"strategy={name!r} puts parameters and optimizer states on NVMe and needs to know where: set "
                "ZINF_NVME_PATHS=/mnt/nvme0[:/mnt/nvme1...] or pass ZeroInfinityStrategy({'offload': {'params': "
                "'nvme', 'optimizer': 'nvme', 'nvme_paths': [...]}}).")
        offload = {"params": "nvme", "optimizer": "nvme", "nvme_paths": paths}
    base = zinf.ZeroConfig.from_dict({"offload": offload}).to_dict()
    if config is not None:
        # a whole config (a ZeroConfig, a typed Hydra node) carries every default: only what it changes goes on top
        user = dict(config) if type(config) is dict else \
            _changed(resolve_config(config).to_dict(), zinf.ZeroConfig().to_dict())
        base = {**base, **user, "offload": {**base["offload"], **dict(user.get("offload", {}))}}
    return base


def _changed(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(defaults.get(k), dict):
            sub = _changed(v, defaults[k])
            if sub:
                out[k] = sub
        elif k not in defaults or defaults[k] != v:
            out[k] = v
    return out


def register_names(registry: Any, strategy: type, offload: type) -> None:
    """Register ``NAME`` for ``strategy`` and the offload presets for ``offload`` in one strategy registry
    (Lightning's ``StrategyRegistry`` or Fabric's ``STRATEGY_REGISTRY``, of the unified package or a
    standalone one); names already there are left as they are."""
    if NAME not in registry:
        registry.register(NAME, strategy, description=_DESCRIPTION)
    for preset in OFFLOAD_PRESETS:
        if preset not in registry:
            registry.register(preset, offload, description=f"{_DESCRIPTION} ({'NVMe' if 'nvme' in preset else 'CPU'} offload)",
                              preset=preset)
