"""[Note: a 4-bit base] in zinf/integrations/quantized.py on real gloo processes: ``from_pretrained`` with a
``BitsAndBytesConfig(load_in_4bit=True)`` under ``zinf.Init`` stores the base's linear weights in 4 bits, and each
gathered weight equals bitsandbytes' own dequantized weight bit for bit (NF4 and FP4, with and without double
quantization, a weight whose last block is partial, 1 and 2 ranks, parameters in memory and on NVMe); the 4-bit
shards hold at most 0.57 bytes per parameter; training or editing a 4-bit weight is refused with the fix."""

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


def _config():
    from transformers import LlamaConfig

    # hidden 40: k_proj and v_proj are 20 x 40 = 800 elements, 12.5 blocks of 64 (a partial last block)
    return LlamaConfig(vocab_size=96, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_fp32")
    torch.manual_seed(11)
    LlamaForCausalLM(_config()).save_pretrained(path, max_shard_size="60KB")
    return path


def _bnb(quant_type: str, double: bool, storage: torch.dtype = torch.uint8):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                              bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)


def reference_weights(path: Path, quant_type: str, double: bool) -> dict[str, torch.Tensor]:
    """Each 4-bit weight as bitsandbytes dequantizes it, from plain transformers (this process, no zinf)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=_bnb(quant_type, double))
    return {f"{n}.weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
            for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


@pytest.mark.parametrize("world,quant_type,double,nvme", [
    (2, "nf4", False, False), (2, "nf4", True, True), (2, "fp4", True, False), (1, "fp4", False, False)])
def test_gathered_four_bit_weights_equal_bitsandbytes(checkpoint: Path, tmp_path: Path, world: int, quant_type: str,
                                                      double: bool, nvme: bool) -> None:
    expected = reference_weights(checkpoint, quant_type, double)
    results = run_distributed(load_quantized, world, str(checkpoint), str(tmp_path / "nvme") if nvme else None,
                              _bnb(quant_type, double))
    for r in results:
        assert r["marked"] == [4]
        # 7 linear layers a block, lm_head kept (gathered too, with the norm)
        assert set(r["weights"]) == set(expected) | {"model.norm.weight", "lm_head.weight"} and len(expected) == 14
        for n, w in expected.items():
            assert torch.equal(r["weights"][n], w), n
        # this rank's 4-bit shards: half a byte per element and an fp32 scale per 64 (padding to whole blocks)
        assert r["bytes"] / (r["numel"] / world) <= 0.57 + 64 * 14 / r["numel"], r


def test_training_a_four_bit_weight_is_refused(checkpoint: Path) -> None:
    message = run_distributed(train_quantized, 2, str(checkpoint), _bnb("nf4", False))[0]
    assert "stored in 4 bits" in message and "LoRA" in message, message


def test_a_model_bitsandbytes_quantized_before_zinf_is_refused(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, quantization_config=_bnb("nf4", False))
    with pytest.raises(UnsupportedModelError, match="quantized by bitsandbytes .Params4bit. before zinf saw"):
        zinf.initialize(model, None, {"precision": "fp32"})


def test_a_tied_output_layer_is_not_stored_in_four_bits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = _config()
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    bnb_config = _bnb("nf4", False)
    bnb_config.llm_int8_skip_modules = ["o_proj"]  # a list of its own: transformers' rule then converts lm_head too
    with pytest.raises(UnsupportedModelError, match="lm_head's weight is tied to model.embed_tokens"):
        with zinf.Init(zinf.ZeroConfig.from_dict({"precision": "fp32"})):
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quantization_config=bnb_config)


def _qlora_shaped(path: str, nvme: str, saved: bool = False):
    """The 4-bit base frozen, the norms trained (QLoRA's shape without peft), parameters on NVMe; ``path`` a plain
    checkpoint quantized at loading, or one saved in 4 bits (its codes and scales read where they lie)."""
    from transformers import AutoModelForCausalLM

    os.makedirs(nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({"precision": "fp32", "offload": {
        "params": "nvme", "optimizer": "cpu", "nvme_paths": [nvme], "pinned_pool_bytes": 4 << 20}})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     **({} if saved else {"quantization_config": _bnb("nf4", True)}))
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return zinf.initialize(model, opt, config)


def _resume(rank: int, world: int, path: str, root: str, saved: bool) -> dict:
    from models import token_batches
    from training import lm_step_global

    batches = token_batches(4, 4)
    engine = _qlora_shaped(path, os.path.join(root, "a"), saved)
    straight = [lm_step_global(engine, x, rank, world) for x in batches[:2]]
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    straight += [lm_step_global(engine, x, rank, world) for x in batches[2:]]
    engine.close()
    engine = _qlora_shaped(path, os.path.join(root, "b"), saved)
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    resumed = [lm_step_global(engine, x, rank, world) for x in batches[2:]]
    engine.close()
    return {"straight": straight, "resumed": resumed}


@pytest.mark.parametrize("base", ["quantized at loading", "saved in 4 bits"])
def test_a_four_bit_base_resumes_from_a_checkpoint_bit_for_bit(checkpoint: Path, tmp_path: Path, base: str) -> None:
    path = checkpoint
    if base == "saved in 4 bits":  # NF4 read in place: k_proj's last block is partial, its padding codes as read
        from transformers import AutoModelForCausalLM

        path = tmp_path / "saved"
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                             quantization_config=_bnb("nf4", False)).save_pretrained(path)
    for r in run_distributed(_resume, 2, str(path), str(tmp_path), base == "saved in 4 bits"):
        assert r["straight"][2:] == r["resumed"], r
        assert r["straight"][0] != r["straight"][1]  # it trains


SHAPES = ((100, 7), (64, 64), (5, 13))  # 700 elements (a partial last block), 4096, 65 (one element past a block)


def _group_gathers(rank: int, world: int, quant_type: str, double: bool) -> dict:
    """One 4-bit group of three odd-sized weights: gathered by both ranks, then by rank 0 while rank 1 holds it
    gathered (rank 1 serves the gather from its store's shard: [Note: rounds] in zinf/schedule/rounds.py)."""
    from zinf.param.flat_group import FlatParamGroup
    from zinf.param.four_bit import FourBitFormat
    from zinf.runtime.comm import Comm
    from zinf.runtime.context import RunContext

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * (i + 1), requires_grad=False) for i, s in enumerate(SHAPES)]
    full = [p.detach().clone() for p in params]
    group = FlatParamGroup("w", params, ["a", "b", "c"], rank, world, torch.float32, torch.device("cpu"),
                           quantized=FourBitFormat(quant_type, 64, double))
    ctx = RunContext.build(Comm.current(device=torch.device("cpu")), torch.device("cpu"))
    group.to_gathered(ctx)
    first = [p.detach().clone() for p in group.params]
    if rank == 0:
        group.to_sharded()
        group.to_gathered(ctx)
    else:
        group.serve_gather(ctx)
    second = [p.detach().clone() for p in group.params]
    return {"first": first, "second": second, "full": full, "bytes": group.shard_nbytes,
            "shard_numel": group.shard_numel}


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_an_odd_sized_group_gathers_and_serves_bitsandbytes_values(quant_type: str, double: bool) -> None:
    from bitsandbytes import functional as bnb_f

    results = run_distributed(_group_gathers, 2, quant_type, double)
    expected = []
    for value in results[0]["full"]:
        packed, state = bnb_f.quantize_4bit(value, blocksize=64, compress_statistics=double, quant_type=quant_type)
        expected.append(bnb_f.dequantize_4bit(packed, state))
    for r in results:
        for got in (r["first"], r["second"]):
            for g, e in zip(got, expected):
                assert torch.equal(g, e)
        # slots at 0, 704 and 4,800 (block boundaries): 4,865 elements in 2 shards of 2,496 (39 blocks each)
        assert r["shard_numel"] == 2496 and r["bytes"] == 2496 // 2 + 39 * 4


# the last: codes packed two bytes an element (bnb_4bit_quant_storage=torch.bfloat16), read from memory as bytes
@pytest.mark.parametrize("quant_type,double,nvme,storage", [("nf4", True, False, torch.uint8),
                                                            ("fp4", False, True, torch.uint8),
                                                            pytest.param("nf4", True, True, torch.uint8,
                                                                         marks=pytest.mark.slow),
                                                            pytest.param("nf4", False, False, torch.bfloat16,
                                                                         marks=pytest.mark.slow)])
def test_a_checkpoint_saved_in_four_bits_loads_as_bitsandbytes_reads_it(checkpoint: Path, tmp_path: Path,
                                                                       quant_type: str, double: bool, nvme: bool,
                                                                       storage: torch.dtype) -> None:
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                 quantization_config=_bnb(quant_type, double, storage))
    saved.save_pretrained(tmp_path / "four_bit", max_shard_size="30KB")
    expected = {f"{n}.weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
                for n, m in saved.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    expected.update({"model.norm.weight": saved.model.norm.weight.detach(), "lm_head.weight": saved.lm_head.weight.detach()})
    for result in run_distributed(load_quantized, 2, str(tmp_path / "four_bit"), str(tmp_path / "nvme") if nvme else None):
        got = result["weights"]
        assert result["marked"] == [4]
        assert set(got) == set(expected) and len(expected) == 16
        for n, w in expected.items():
            assert torch.equal(got[n], w), n
        if nvme and not double:  # codes and fp32 scales read where they lie: nothing of the base in swap
            assert result["nvme"].get("frozen_in_checkpoint", 0) >= result["quantized_bytes"] > 0, result
            assert result["nvme"].get("param_shards", 0) == 0, result
        elif nvme:  # double-quantized scales are decoded first: the 4-bit shards go to swap
            assert result["nvme"]["param_shards"] >= result["quantized_bytes"] > 0, result
