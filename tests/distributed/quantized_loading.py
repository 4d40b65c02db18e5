"""Loading a quantized base under zinf on each gloo rank, for test_four_bit.py and test_eight_bit.py."""

from __future__ import annotations

import os

import torch

import zinf


def load_quantized(rank: int, world: int, path: str, nvme: str | None, quantization_config=None) -> dict:
    """``from_pretrained`` with ``quantization_config`` (None: a checkpoint bitsandbytes saved in 4 or 8 bits): every
    quantized weight gathered, with the norm and the output layer; this rank's quantized shard bytes and the elements
    they hold (before the engine), the engine's bytes on NVMe and of its quantized shards, and the bit widths
    transformers' flags mark the model with."""
    from transformers import AutoModelForCausalLM

    from zinf.integrations.quantized import all_quantized, quantized_bytes

    if nvme:
        os.makedirs(nvme, exist_ok=True)
    offload = {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20} if nvme else {}
    config = zinf.ZeroConfig.from_dict({"precision": "fp32", "offload": offload})
    load = {} if quantization_config is None else {"quantization_config": quantization_config}
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
    nbytes, numel = quantized_bytes(model)
    model.requires_grad_(False)
    engine = zinf.initialize(model, None, config)
    params = dict(model.named_parameters())
    weights = {}
    for n in all_quantized(model) + ["model.norm.weight", "lm_head.weight"]:
        with zinf.GatheredParameters(params[n]):
            weights[n] = params[n].detach().clone()
    nvme_bytes = engine.resident_bytes().get("nvme", {})
    quantized = sum(g.shard_nbytes for g in engine.groups if g.quantized is not None)
    engine.close()
    return {"weights": weights, "bytes": nbytes, "numel": numel, "nvme": nvme_bytes, "quantized_bytes": quantized,
            "marked": [bits for bits in (4, 8) if getattr(model, f"is_loaded_in_{bits}bit", False)]}


def train_quantized(rank: int, world: int, path: str, quantization_config) -> str:
    """An engine asked to train every parameter of a base loaded with ``quantization_config``: the error it raises."""
    from transformers import AutoModelForCausalLM

    from zinf.errors import UnsupportedModelError

    config = zinf.ZeroConfig.from_dict({"precision": "fp32"})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quantization_config)
    try:
        zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    except UnsupportedModelError as e:
        return str(e)
    return "built"
