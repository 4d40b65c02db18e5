"""[Note: 8-bit shards] in zinf/param/eight_bit.py on real gloo processes: ``from_pretrained`` with
``BitsAndBytesConfig(load_in_8bit=True)`` under ``zinf.Init`` stores the base's linear weights in bitsandbytes' 8-bit
format, and each gathered weight equals the weight bitsandbytes' CPU training path decodes, bit for bit (1 and 2
ranks, parameters in memory and on NVMe); the shards hold one byte a parameter and a scale a row; a checkpoint
bitsandbytes saved in 8 bits loads as bitsandbytes reads it (on NVMe, read where it lies); training an 8-bit weight
and ``llm_int8_has_fp16_weight`` are refused with the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from quantized_loading import load_quantized, train_quantized
from zinf.errors import UnsupportedModelError

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_fp32")
    torch.manual_seed(12)
    # hidden 40, 2 ranks: k_proj's 20 rows of 40 split 10 and 10; gate_proj's 72 rows, down_proj's 40 rows of 72
    config = LlamaConfig(vocab_size=96, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="60KB")
    return path


def _bnb(**kwargs):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, **kwargs)


def reference_weights(path: Path, saved: bool = False) -> dict[str, torch.Tensor]:
    """Each 8-bit weight as bitsandbytes' CPU training path decodes it (``MatMul8bitFp``), from plain transformers
    in this process (``path`` unquantized, or saved in 8 bits)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    load = {} if saved else {"quantization_config": _bnb()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear8bitLt):
            w = m.weight
            out[f"{name}.weight"] = w.data.to(torch.float32).mul_(w.SCB.unsqueeze(1).mul(1.0 / 127.0))
    return out


@pytest.mark.parametrize("world,nvme", [(1, False), (2, False), (2, True)])
def test_gathered_eight_bit_weights_equal_bitsandbytes(checkpoint: Path, tmp_path: Path, world: int,
                                                       nvme: bool) -> None:
    expected = reference_weights(checkpoint)
    results = run_distributed(load_quantized, world, str(checkpoint), str(tmp_path / "nvme") if nvme else None, _bnb())
    for r in results:
        assert r["marked"] == [8]
        # 7 linear layers a block, lm_head kept (gathered too, with the norm)
        assert set(r["weights"]) == set(expected) | {"model.norm.weight", "lm_head.weight"} and len(expected) == 14
        for n, w in expected.items():
            assert torch.equal(r["weights"][n], w), n
        # a byte an element and an fp32 scale a row of 40 or 72 (hidden 40: at most 1.1 bytes a parameter)
        assert r["bytes"] / (r["numel"] / world) <= 1 + 4 / 40, r


def test_training_an_eight_bit_weight_is_refused(checkpoint: Path) -> None:
    message = run_distributed(train_quantized, 2, str(checkpoint), _bnb())[0]
    assert "stored in 8 bits" in message and "LoRA" in message, message


def test_sixteen_bit_weights_beside_the_codes_are_refused_with_the_fix(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("ZINF_QUIET", "1")
    with pytest.raises(UnsupportedModelError, match="drop llm_int8_has_fp16_weight"):
        with zinf.Init(zinf.ZeroConfig.from_dict({"precision": "fp32"})):
            AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_bnb(llm_int8_has_fp16_weight=True))


@pytest.mark.parametrize("nvme", [False, True])
def test_a_checkpoint_saved_in_eight_bits_loads_as_bitsandbytes_reads_it(checkpoint: Path, tmp_path: Path,
                                                                        nvme: bool) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, quantization_config=_bnb())
    saved.save_pretrained(tmp_path / "eight_bit", max_shard_size="30KB")
    expected = reference_weights(tmp_path / "eight_bit", saved=True)
    expected.update({"model.norm.weight": saved.model.norm.weight.detach(),
                     "lm_head.weight": saved.lm_head.weight.detach()})
    for r in run_distributed(load_quantized, 2, str(tmp_path / "eight_bit"), str(tmp_path / "nvme") if nvme else None):
        assert r["marked"] == [8]
        assert set(r["weights"]) == set(expected) and len(expected) == 16
        for n, w in expected.items():
            assert torch.equal(r["weights"][n], w), n
        if nvme:  # codes and scales read where they lie: nothing of the base in swap
            assert r["nvme"].get("frozen_in_checkpoint", 0) >= r["quantized_bytes"] > 0, r
            assert r["nvme"].get("param_shards", 0) == 0, r
