"""``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` under zinf: QLoRA's frozen
4-bit base, partitioned.

[Note: a 4-bit base]
transformers with bitsandbytes replaces each ``nn.Linear`` (but the output embedding, tied weights, the last module
and ``llm_int8_skip_modules``) by a ``Linear4bit`` whose weight is bitsandbytes' codes. Under zinf the model keeps
its ``nn.Linear`` layers and their weights are stored in 4 bits instead: after zinf's streaming loader has read each
rank's slices, each such weight is gathered alone (one layer at a time: no rank ever holds the base) and cut into
4-bit shards, each rank quantizing its own blocks as bitsandbytes does ([Note: 4-bit shards] in
zinf/param/four_bit.py). Every gather decodes exactly bitsandbytes' dequantized weight, and the layer computes
``F.linear`` on it, as ``Linear4bit`` does on the CPU. A checkpoint saved in 4 bits is read as it is (empty 4-bit
groups, filled by zinf/checkpoint/four_bit_files.py). The layers to convert are chosen by transformers' own rule
(``get_modules_to_not_convert``, ``should_convert_module``). The model is marked ``is_loaded_in_4bit`` as
transformers marks it, so peft's ``prepare_model_for_kbit_training`` and TRL treat it as the quantized model it is;
peft's LoRA wraps the plain ``nn.Linear`` layers. The 4-bit weights are frozen: training or editing them is refused
with the fix.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import FlatParamGroup
from zinf.param.four_bit import FourBitFormat, convertible_linears
from zinf.param.gathered import gather_full_master
from zinf.param.partition import partition_module_params
from zinf.param.registry import group_of, unregister
from zinf.runtime.comm import Comm

__all__ = ["four_bit_format", "quantize_base", "prepare_saved_four_bit", "all_four_bit", "four_bit_bytes"]

log = logging.getLogger(__name__)


def four_bit_format(config: Any) -> tuple[FourBitFormat, Any]:
    """The 4-bit storage a ``quantization_config`` asks for, and the config as a ``BitsAndBytesConfig``; a request
    zinf does not carry out is refused with the fix."""
    from transformers import BitsAndBytesConfig

    if isinstance(config, dict):
        if config.get("quant_method", "bitsandbytes") != "bitsandbytes":
            raise UnsupportedModelError(
                f"zinf: a {config.get('quant_method')} quantization: zinf stores bitsandbytes' 4-bit formats only. Load "
                "an unquantized checkpoint, with BitsAndBytesConfig(load_in_4bit=True, ...) for a 4-bit base.")
        config = BitsAndBytesConfig.from_dict(config)
    if not isinstance(config, BitsAndBytesConfig):
        raise UnsupportedModelError(
            f"zinf: from_pretrained(quantization_config={type(config).__name__}(...)): zinf stores bitsandbytes' 4-bit "
            "formats only. Pass BitsAndBytesConfig(load_in_4bit=True, ...), or drop quantization_config.")
    if not config.load_in_4bit:
        raise UnsupportedModelError(
            "zinf: from_pretrained(quantization_config=BitsAndBytesConfig(load_in_8bit=True)): zinf stores 4-bit bases "
            "(NF4, FP4) only. Use BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), or drop "
            "quantization_config.")
    return FourBitFormat(config.bnb_4bit_quant_type, 64, bool(config.bnb_4bit_use_double_quant)), config


def quantize_base(model: Any, fmt: FourBitFormat, config: Any, comm: Comm) -> int:
    """Store the weights of ``model``'s convertible ``nn.Linear`` layers in 4 bits (see [Note: a 4-bit base]);
    returns how many. Every rank calls it, in the same order (each layer is gathered through ``comm``)."""
    compute_dtype = None
    converted = 0
    targets = convertible_linears(model, config.llm_int8_skip_modules)
    start = shown = time.monotonic()
    for name, module in targets:
        if time.monotonic() - shown > 10:  # long work shows progress
            shown = time.monotonic()
            log.info("zinf: 4-bit: %d/%d linear layers quantized, %.0f s", converted, len(targets), shown - start)
        weight = module.weight
        group = group_of(weight)
        if group is None:
            raise UnsupportedModelError(f"zinf: {name}.weight is not partitioned; quantize a model loaded under "
                                        "zinf.Init or zinf launch.")
        if group.four_bit is not None:
            continue
        if group.residence.placed:
            raise UnsupportedModelError(f"zinf: {name} belongs to an engine already; load the model with "
                                        "quantization_config before building the engine.")
        _regroup(module, name, group, fmt, comm, gather_full_master(comm, group))
        compute_dtype = group.compute_dtype
        converted += 1
    if compute_dtype is not None and config.bnb_4bit_compute_dtype not in (None, compute_dtype):
        log.warning("zinf: bnb_4bit_compute_dtype=%s, but zinf computes the 4-bit layers in its own compute dtype, "
                    "%s (set zinf's precision to change it).", config.bnb_4bit_compute_dtype, compute_dtype)
    model.is_loaded_in_4bit = True  # as transformers marks a 4-bit model: peft and TRL prepare it as one
    if converted:
        log.info("zinf: %d linear layers stored in 4 bits (%s%s) in %.1f s", converted, fmt.quant_type,
                 ", double quantization" if fmt.double_quant else "", time.monotonic() - start)
    return converted


def _regroup(module: nn.Linear, name: str, group: FlatParamGroup, fmt: FourBitFormat, comm: Comm,
             full: torch.Tensor | None) -> None:
    """``module``'s weight into a 4-bit group, and anything else ``group`` held (a bias) into a group of its own.
    With ``full`` (``group``'s gathered values) the new groups are built from them; without, they are empty, for a
    loader to fill. A group built for NVMe under ``zinf.Init`` waits in its spill, and so do the new ones."""
    weight, spill = module.weight, group.residence.spill
    members = [(p, slot) for p, slot in zip(group.params, group.slots) if p is not None]
    for p, slot in members:
        unregister(p)
        if full is not None:
            p.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to(slot.dtype, copy=True)
        elif p is not weight and spill is None:  # a bias: a master cut from zeros, which the files replace
            p.data = torch.zeros(p.shape, dtype=group.compute_dtype, device=group.device)
    empty = full is None
    del full  # the values are the parameters' now: one layer's full vector at a time
    kw = dict(comm=comm, compute_dtype=group.compute_dtype, device=group.device, agree=False)
    made = [partition_module_params(module, name, **kw, only={id(weight)}, four_bit=fmt, placeholders=empty)]
    rest = {id(p) for p, _ in members if p is not weight}
    if rest:
        made.append(partition_module_params(module, group.name, **kw, only=rest, storage_dtype=group.storage_dtype,
                                            placeholders=empty and spill is not None))
    for new in made:
        if spill is not None and new is not None:
            new.spill_to(spill, placeholders=empty)


def prepare_saved_four_bit(model: Any, fmt: FourBitFormat, config: Any, comm: Comm) -> int:
    """Before a checkpoint saved in 4 bits is read: the layers it holds in 4 bits get empty 4-bit groups, which the
    loader fills with the files' codes and scales (zinf/checkpoint/four_bit_files.py). Nothing is gathered."""
    made = 0
    for name, module in convertible_linears(model, config.llm_int8_skip_modules):
        group = group_of(module.weight)
        if group is None or group.four_bit is not None:
            continue
        _regroup(module, name, group, fmt, comm, None)
        made += 1
    log.info("zinf: %d linear layers read in 4 bits (%s) from the checkpoint", made, fmt.quant_type)
    return made


def all_four_bit(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters stored in 4 bits."""
    return [n for n, p in model.named_parameters() if getattr(group_of(p), "four_bit", None) is not None]


def four_bit_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's 4-bit shards, elements of the weights they hold)."""
    groups = {id(g): g for p in model.parameters() if (g := group_of(p)) is not None and g.four_bit is not None}
    return sum(g.shard_nbytes for g in groups.values()), sum(g.numel for g in groups.values())

