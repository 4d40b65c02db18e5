"""Whether a checkpoint's tensors are the weights of the model that ``--config`` describes (``zinf consolidate
--format hf``): the model is built from the config on the meta device (no memory, no values) and its state_dict's
names and shapes are compared with the checkpoint's record, before anything is written. Without this check
``from_pretrained(OUT)`` would load files holding another model's weights and initialise the missing ones randomly.

A name the checkpoint lacks is fine when the model ties it to a name the checkpoint has (``lm_head.weight`` tied
to the embeddings, written once); a non-persistent buffer is in no state_dict, so it is neither expected nor refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from zinf.errors import ConfigError

__all__ = ["check_config_matches"]

log = logging.getLogger("zinf")
_SHOWN = 4  # names listed of each kind


def _meta_model(config_file: Path) -> torch.nn.Module | None:
    """The model ``config_file`` describes, on the meta device; None (with a warning) where it cannot be built here."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        log.warning("zinf consolidate: transformers is not installed, so the checkpoint's names and shapes are not "
                    "checked against --config %s", config_file)
        return None
    raw = json.loads(config_file.read_text())
    if raw.get("auto_map"):
        log.warning("zinf consolidate: --config %s names the model's own code (auto_map), so the checkpoint's names "
                    "and shapes are not checked against it", config_file)
        return None
    try:
        config = AutoConfig.from_pretrained(str(config_file))
        arch = next((getattr(transformers, a, None) for a in raw.get("architectures") or []), None)
        with torch.device("meta"):
            return arch(config) if arch is not None else AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a config it cannot build
        text = " ".join(str(exc).split())[:300]
        raise ConfigError(f"zinf consolidate: --config {str(config_file)!r} is not a config transformers can build a "
                          f"model from ({type(exc).__name__}: {text}). Pass the config.json of the model the "
                          "checkpoint was trained from, or use --format safetensors for the weights alone.") from None


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def check_config_matches(config_file: Path, specs: list, tied: dict[str, str]) -> None:
    """Raise ConfigError naming --config when the checkpoint's tensors (``specs`` and the ``tied`` aliases, from
    :func:`zinf.checkpoint.sharded.state_specs`) are not the state_dict of the model ``config_file`` describes."""
    model = _meta_model(config_file)
    if model is None:
        return
    expected = model.state_dict(keep_vars=True)
    shapes = {spec.name: tuple(spec.shape) for spec in specs}
    shapes.update((alias, shapes[first]) for alias, first in tied.items() if first in shapes)
    held = {id(tensor) for name, tensor in expected.items() if name in shapes}
    missing = [n for n, t in expected.items() if n not in shapes and id(t) not in held]
    persistent = set(expected)
    unsaved = {n for n, _ in model.named_buffers()} - persistent
    unexpected = [n for n in shapes if n not in persistent and n not in unsaved]
    mis_shaped = [f"{n} {list(shapes[n])} (config: {list(t.shape)})" for n, t in expected.items()
                  if n in shapes and shapes[n] != tuple(t.shape)]
    if not (missing or unexpected or mis_shaped):
        return
    found = [f"{len(missing)} weight(s) of the model missing from the checkpoint ({_listed(missing)})" if missing
             else "", f"{len(unexpected)} tensor(s) the model does not have ({_listed(unexpected)})" if unexpected
             else "", f"{len(mis_shaped)} of another shape ({_listed(mis_shaped)})" if mis_shaped else ""]
    raise ConfigError(f"zinf consolidate: --config {str(config_file)!r} describes another model than the checkpoint "
                      f"holds: {'; '.join(f for f in found if f)}. from_pretrained would initialise the missing "
                      "weights randomly. Pass the config of the model the checkpoint was trained from (the "
                      "directory it was loaded from), or use --format safetensors for the weights alone.")
