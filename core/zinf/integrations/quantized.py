"""``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` under zinf: QLoRA's frozen
4-bit base, partitioned; ``load_in_8bit=True`` the same way, in bitsandbytes' 8-bit format.

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

With ``load_in_8bit`` the same path stores each weight as ``Linear8bitLt`` would hold it ([Note: 8-bit shards] in
zinf/param/eight_bit.py) and marks the model ``is_loaded_in_8bit``; a checkpoint saved in 8 bits is read as it is
(zinf/checkpoint/eight_bit_files.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.param.flat_group import FlatParamGroup
from zinf.param.eight_bit import EightBitFormat, QuantizedFormat
from zinf.param.four_bit import FourBitFormat, convertible_linears
from zinf.param.gathered import gather_full_master
from zinf.param.partition import partition_module_params
from zinf.param.registry import group_of, unregister
from zinf.runtime.comm import Comm

__all__ = ["quantized_format", "quantize_base", "prepare_saved", "all_quantized", "quantized_bytes"]

log = logging.getLogger(__name__)


def quantized_format(config: Any) -> tuple[QuantizedFormat, Any]:
    """The storage a ``quantization_config`` asks for (4-bit or 8-bit), and the config as a ``BitsAndBytesConfig``;
    a request zinf does not carry out is refused with the fix."""
    from transformers import BitsAndBytesConfig

    if isinstance(config, dict):
        if config.get("quant_method", "bitsandbytes") != "bitsandbytes":
            raise UnsupportedModelError(
                f"zinf: a {config.get('quant_method')} quantization: zinf stores bitsandbytes' 4-bit and 8-bit formats "
                "only. Load an unquantized checkpoint, with BitsAndBytesConfig(load_in_4bit=True, ...) for a 4-bit "
                "base.")
        config = BitsAndBytesConfig.from_dict(config)
    if not isinstance(config, BitsAndBytesConfig):
        raise UnsupportedModelError(
            f"zinf: from_pretrained(quantization_config={type(config).__name__}(...)): zinf stores bitsandbytes' 4-bit "
            "and 8-bit formats only. Pass BitsAndBytesConfig(load_in_4bit=True, ...), or drop quantization_config.")
    if config.load_in_8bit:
        if config.llm_int8_has_fp16_weight:
            raise UnsupportedModelError(
                "zinf: BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True) trains the 16-bit weights "
                "it keeps beside the 8-bit ones. Load without quantization_config to train the weights, or drop "
                "llm_int8_has_fp16_weight for a frozen 8-bit base.")
        return EightBitFormat(), config
    if not config.load_in_4bit:
        raise UnsupportedModelError(
            "zinf: a BitsAndBytesConfig with neither load_in_4bit nor load_in_8bit quantizes nothing. Pass "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), or drop quantization_config.")
    return FourBitFormat(config.bnb_4bit_quant_type, 64, bool(config.bnb_4bit_use_double_quant)), config


def quantize_base(model: Any, fmt: QuantizedFormat, config: Any, comm: Comm) -> int:
    """Store the weights of ``model``'s convertible ``nn.Linear`` layers in ``fmt`` (see [Note: a 4-bit base]);
    returns how many. Every rank calls it, in the same order (each layer is gathered through ``comm``)."""
    compute_dtype = None
    converted = 0
    targets = convertible_linears(model, config.llm_int8_skip_modules)
    start = shown = time.monotonic()
    for name, module in targets:
        if time.monotonic() - shown > 10:  # long work shows progress
            shown = time.monotonic()
            log.info("zinf: %d-bit: %d/%d linear layers quantized, %.0f s", fmt.bits, converted, len(targets),
                     shown - start)
        weight = module.weight
        group = group_of(weight)
        if group is None:
            raise UnsupportedModelError(f"zinf: {name}.weight is not partitioned; quantize a model loaded under "
                                        "zinf.Init or zinf launch.")
        if group.quantized is not None:
            continue
        if group.residence.placed:
            raise UnsupportedModelError(f"zinf: {name} belongs to an engine already; load the model with "
                                        "quantization_config before building the engine.")
        _regroup(module, name, group, fmt.for_weight(weight), comm, gather_full_master(comm, group))
        compute_dtype = group.compute_dtype
        converted += 1
    if fmt.bits == 4 and compute_dtype is not None and config.bnb_4bit_compute_dtype not in (None, compute_dtype):
        log.warning("zinf: bnb_4bit_compute_dtype=%s, but zinf computes the 4-bit layers in its own compute dtype, "
                    "%s (set zinf's precision to change it).", config.bnb_4bit_compute_dtype, compute_dtype)
    # as transformers marks a quantized model: peft and TRL prepare it as one
    setattr(model, f"is_loaded_in_{fmt.bits}bit", True)
    if converted:
        kind = (f"4 bits ({fmt.quant_type}{', double quantization' if fmt.double_quant else ''})"
                if isinstance(fmt, FourBitFormat) else "8 bits (LLM.int8 rows)")
        log.info("zinf: %d linear layers stored in %s in %.1f s", converted, kind, time.monotonic() - start)
    return converted


def _regroup(module: nn.Linear, name: str, group: FlatParamGroup, fmt: QuantizedFormat, comm: Comm,
             full: torch.Tensor | None) -> None:
    """``module``'s weight into a quantized group, and anything else ``group`` held (a bias) into a group of its own.
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
    made = [partition_module_params(module, name, **kw, only={id(weight)}, quantized=fmt, placeholders=empty)]
    rest = {id(p) for p, _ in members if p is not weight}
    if rest:
        made.append(partition_module_params(module, group.name, **kw, only=rest, storage_dtype=group.storage_dtype,
                                            placeholders=empty and spill is not None))
    for new in made:
        if spill is not None and new is not None:
            new.spill_to(spill, placeholders=empty)


def prepare_saved(model: Any, fmt: QuantizedFormat, config: Any, comm: Comm) -> int:
    """Before a checkpoint saved quantized is read: the layers it holds in 4 or 8 bits get empty groups of that
    format, which the loader fills with the files' codes and scales (zinf/checkpoint/four_bit_files.py,
    eight_bit_files.py). Nothing is gathered."""
    made = 0
    for name, module in convertible_linears(model, config.llm_int8_skip_modules):
        group = group_of(module.weight)
        if group is None or group.quantized is not None:
            continue
        _regroup(module, name, group, fmt.for_weight(module.weight), comm, None)
        made += 1
    log.info("zinf: %d linear layers read in %d bits from the checkpoint", made, fmt.bits)
    return made


def all_quantized(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters stored in 4 or 8 bits."""
    return [n for n, p in model.named_parameters() if getattr(group_of(p), "quantized", None) is not None]


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's 4-bit or 8-bit shards, elements of the weights they hold)."""
    groups = {id(g): g for p in model.parameters() if (g := group_of(p)) is not None and g.quantized is not None}
    return sum(g.shard_nbytes for g in groups.values()), sum(g.numel for g in groups.values())

