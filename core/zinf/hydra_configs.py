"""The engine config and the front ends as Hydra structured configs, with presets.

``register_configs()`` stores these nodes in Hydra's ``ConfigStore``; call it once at module level of the
app, before ``@hydra.main`` runs (or before ``hydra.initialize``/``compose``)::

    from zinf.hydra_configs import register_configs
    register_configs()

    @hydra.main(version_base=None, config_path=".", config_name="config")  # defaults: [zinf: default, _self_]
    def main(cfg):
        zero_config = zinf.ZeroConfig.from_dict(cfg.zinf)

Then ``python train.py zinf=nvme zinf.offload.nvme_paths=[/mnt/a,/mnt/b]`` composes (``+zinf=nvme`` when the
app's defaults list names no ``zinf`` preset).

What is stored:

- group ``zinf``: ``schema`` (:class:`zinf.ZeroConfig` itself, every default) and the presets of
  :data:`PRESETS`, each the schema with the preset's settings on top. Every ``zinf`` node is typed by
  ``ZeroConfig``, so Hydra refuses a misspelt key (``zinf.offlaod.params=cpu``) or a value of the wrong type
  (``zinf.gradient_clipping=abc``) when it composes, naming the key. The allowed values (``offload.params``
  one of device/cpu/nvme, ``gradient_clipping`` >= 0, ...) are the engine's to check: ``ZeroConfig.from_dict``
  (or ``OmegaConf.to_object``) refuses them naming the key, as it refuses a ``???`` left unset. One preset per
  run; add single settings as overrides (``zinf=nvme zinf.precision=bf16``): a preset is a whole config, so
  ``zinf=[nvme,bf16]`` would merge bf16's defaults over nvme's offload settings.
- group ``strategy``: ``zero_infinity`` (``lightning_zinf.ZeroInfinityStrategy``) and ``zero_infinity_fabric``
  (``lightning_zinf.ZeroInfinityFabricStrategy``), with ``config: ${zinf}``: the strategy is built by
  ``hydra.utils.instantiate`` from the composed ``zinf`` node.
- group ``accelerator``: ``zinf`` (``accelerate_zinf.Accelerator`` with ``zinf_config: ${zinf}``); Accelerate's
  own arguments are added as ``+accelerator.mixed_precision=bf16`` and so on.

Your own YAML presets are checked against the same schema when they start with ``defaults: [schema, _self_]``
in a ``zinf/`` directory of your config path.

This module imports without Hydra; ``register_configs`` needs it (``pip install 'zinf[hydra]'``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from omegaconf import MISSING, DictConfig, OmegaConf

from zinf.config import ZeroConfig

__all__ = ["PRESETS", "GROUP", "preset_node", "register_configs"]

GROUP = "zinf"

# name -> settings on top of the ZeroConfig defaults. MISSING (???) is a value the user must give.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    # the engine's defaults: parameters, gradients and optimizer states partitioned on the device, fp32
    "default": {},
    # ZeRO-Offload: fp32 master weights and Adam moments on the CPU, stepped by zinf's CPU-Adam (gradient
    # shards follow them); parameters stay on the device
    "cpu_offload": {"offload": {"optimizer": "cpu"}},
    # parameters too (what Lightning's strategy="zero_infinity_offload" runs)
    "cpu_offload_all": {"offload": {"params": "cpu", "optimizer": "cpu"}},
    # ZeRO-Infinity: parameters, gradients and optimizer states on NVMe, striped over nvme_paths (one
    # directory per drive), which you must give: zinf.offload.nvme_paths=[/mnt/nvme0,/mnt/nvme1]
    "nvme": {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": MISSING}},
    # bf16 compute (gathered parameters and activations), fp32 master weights and gradient reduction
    "bf16": {"precision": "bf16"},
})

# the front ends, built from the composed zinf node by hydra.utils.instantiate (targets by path: importing
# this module imports neither Lightning nor Accelerate)
_FRONT_ENDS: dict[tuple[str, str], dict[str, Any]] = {
    ("strategy", "zero_infinity"): {
        "_target_": "lightning_zinf.ZeroInfinityStrategy", "config": "${zinf}", "start_method": "popen"},
    ("strategy", "zero_infinity_fabric"): {
        "_target_": "lightning_zinf.ZeroInfinityFabricStrategy", "config": "${zinf}", "start_method": "popen"},
    ("accelerator", "zinf"): {"_target_": "accelerate_zinf.Accelerator", "zinf_config": "${zinf}"},
}


def preset_node(name: str) -> DictConfig:
    """The preset ``name`` as a ``ZeroConfig``-typed OmegaConf node (the schema with the preset on top)."""
    if name not in PRESETS:
        raise KeyError(f"zinf: no Hydra preset {name!r}; the presets are {sorted(PRESETS)}.")
    node = OmegaConf.structured(ZeroConfig)
    _assign(node, PRESETS[name])
    return node


def _assign(node: DictConfig, settings: Mapping[str, Any]) -> None:
    # key by key rather than OmegaConf.merge, which keeps the schema's value where the preset says ???
    for key, value in settings.items():
        if isinstance(value, Mapping):
            _assign(node[key], value)
        else:
            node[key] = value


def register_configs() -> None:
    """Store the ``zinf`` schema and presets, and the Lightning and Accelerate front ends, in Hydra's
    ``ConfigStore`` (see the module docstring). Calling it again stores the same nodes again."""
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError as exc:
        raise ImportError("zinf.hydra_configs.register_configs needs Hydra: pip install 'zinf[hydra]'") from exc

    store = ConfigStore.instance()
    store.store(group=GROUP, name="schema", node=ZeroConfig, provider="zinf")
    for name in PRESETS:
        store.store(group=GROUP, name=name, node=preset_node(name), provider="zinf")
    for (group, name), node in _FRONT_ENDS.items():
        store.store(group=group, name=name, node=node, provider="zinf")
