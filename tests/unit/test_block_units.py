"""Which modules are gathered as one unit (zinf/schedule/units.py, [Note: blocks as units]): the model's repeated
blocks by default, found from transformers' ``_no_split_modules`` or from a ModuleList of one class, and never a
block with a tiled layer or one over the gather budget; the modules inside a unit carry no hooks; one rank trains
the same with either policy."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zinf
from models import GPT, GPTConfig, make_optimizer

transformers = pytest.importorskip("transformers")


def _engine(model: nn.Module, **settings) -> zinf.ZeroEngine:
    return zinf.initialize(model, make_optimizer(model), zinf.ZeroConfig.from_dict(settings))


def _zinf_hooks(module: nn.Module) -> int:
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_a_stack_of_blocks_is_gathered_block_by_block_and_the_modules_inside_carry_no_hooks() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3))
    engine = _engine(model)
    assert engine.hooks.units == ["blocks.0", "blocks.1", "blocks.2"]
    for name, module in model.named_modules():
        inside = name.startswith("blocks.") and name.count(".") > 1
        assert (_zinf_hooks(module) == 0) == inside, (name, _zinf_hooks(module))
    engine.close()


def test_unit_policy_modules_gathers_every_module_on_its_own() -> None:
    model = GPT(GPTConfig())
    engine = _engine(model, unit_policy="modules")
    assert engine.hooks.units == []
    assert all(_zinf_hooks(m) for m in model.modules())
    engine.close()


def test_transformers_blocks_come_from_no_split_modules() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                               n_positions=16))
    assert _engine(gpt2).hooks.units == ["transformer.h.0", "transformer.h.1"]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    assert _engine(llama).hooks.units == ["model.layers.0", "model.layers.1"]


def test_a_lora_wrapped_model_keeps_its_decoder_layers_as_units() -> None:
    peft = pytest.importorskip("peft")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    model = peft.get_peft_model(llama, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert _engine(model).hooks.units == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]


def test_configured_units_win_over_the_blocks_around_them() -> None:
    model = GPT(GPTConfig())
    assert _engine(model, unit_modules=["blocks.*.attn"]).hooks.units == ["blocks.0.attn", "blocks.1.attn"]


def test_a_block_with_a_tiled_layer_or_over_the_gather_budget_stays_module_by_module(caplog) -> None:
    caplog.set_level(logging.INFO, logger="zinf")
    tiled = _engine(GPT(GPTConfig()), tiling={"min_numel": 2000, "tiles": [2, 2]})
    assert tiled.hooks.units == []
    # one line for all the blocks set apart for one reason, naming them
    assert "zinf: 2 block(s) (Block: blocks.0, blocks.1) hold a tiled layer" in caplog.text
    caplog.clear()
    # a block of the test GPT: 12,704 parameters (49.6 KiB); its largest module, fc, 16.5 KiB
    small = _engine(GPT(GPTConfig()), overlap={"max_gathered_bytes": 32 * 1024})
    assert small.hooks.units == []
    lines = [r.getMessage() for r in caplog.records if "block(s)" in r.getMessage()]
    assert lines == ["zinf: 2 block(s) (Block: blocks.0, blocks.1) need more than overlap.max_gathered_bytes "
                     "(32.0 KiB) gathered at once: gathered module by module"], lines


def test_a_bad_unit_policy_names_the_setting_and_the_choices() -> None:
    with pytest.raises(zinf.ConfigError, match=r"unit_policy.*'blocks'.*'modules'"):
        zinf.ZeroConfig(unit_policy="layers")


@pytest.mark.parametrize("model_kind", ["gpt", "gpt2"])
def test_one_rank_trains_bit_identically_with_either_policy(model_kind: str) -> None:
    def run(policy: str) -> list[float]:
        torch.manual_seed(0)
        if model_kind == "gpt":
            model = GPT(GPTConfig())
        else:
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_embd=32, n_layer=2, n_head=2, vocab_size=96, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0))
        engine = _engine(model, unit_policy=policy)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            idx = torch.randint(0, 96, (4, 16), generator=g)
            out = engine(idx, idx) if model_kind == "gpt" else engine(input_ids=idx, labels=idx).loss
            loss = out if isinstance(out, torch.Tensor) else out[1]
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        return losses

    assert run("blocks") == run("modules")


def test_a_stack_whose_no_split_classes_are_absent_still_finds_its_blocks() -> None:
    model = GPT(GPTConfig())
    model._no_split_modules = ["SomeOtherModelsLayer"]  # as a wrapper might carry for a model it does not hold
    assert _engine(model).hooks.units == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("vocab,units", [(96, []), (4096, ["blocks.0", "blocks.1"])])
def test_on_nvme_a_block_is_a_unit_only_where_the_staging_pool_keeps_room_for_it(tmp_path, vocab, units) -> None:
    # the pool keeps room to stage the largest single group for one gather: with a 96-token vocabulary that is the
    # 4.2K-parameter fc layer, less than a block's six groups together; with 4096 tokens the embedding (131K)
    (tmp_path / "swap").mkdir()
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp_path / "swap")],
               "pinned_pool_bytes": 16 << 20}
    engine = _engine(GPT(GPTConfig(vocab=vocab)), offload=offload)
    assert engine.hooks.units == units
    engine.close()
