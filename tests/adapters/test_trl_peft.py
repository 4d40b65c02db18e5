"""An unchanged TRL ``SFTTrainer`` + PEFT LoRA fine-tuning script (sft_lora_script.py) on two gloo processes,
under ``zinf launch`` and under plain Accelerate DDP, compared step for step; and what the adapter did."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from launching import EXAMPLES, accelerate_launch, assert_close, zinf_launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("sft_lora_script.py")
FP32_RTOL = 1e-6
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sft_lora_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model_dir(path: Path) -> Path:
    """A tiny Llama (2 layers, hidden 64) and a word-level tokenizer over the script's words, saved as a
    pretrained checkpoint would be: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(_script().WORDS)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"])
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def reference_logits(model_dir: Path) -> torch.Tensor:
    """The next-token logits of the script's first prompt from the pretrained model (plain transformers, here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(model_dir)(_script().PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        return model(**prompt).logits[0, -1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("pretrained"))


def run_script(config: Path, model_dir: Path, out: Path, *, zinf: bool) -> dict:
    args = (str(SCRIPT), str(model_dir), str(out / "output"), str(out / "result.json"))
    if zinf:
        zinf_launch("--config", config, *args)
    else:
        accelerate_launch(config, *args)
    result = json.loads((out / "result.json").read_text())
    assert result["world"] == 2, "each process trained alone"
    return result


def test_sft_lora_under_zinf_launch_trains_like_ddp(model_dir: Path, tmp_path: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "zinf_cpu.yaml").read_text())
    # a generate out of step between the ranks would wait for a gather; fail within a minute, not gloo's 30
    config["zinf"] = {**(config.get("zinf") or {}), "collective_timeout_s": 60}
    (tmp_path / "zinf.yaml").write_text(yaml.safe_dump(config))
    ddp = run_script(EXAMPLES / "accelerate_cpu.yaml", model_dir, tmp_path / "ddp", zinf=False)
    ours = run_script(tmp_path / "zinf.yaml", model_dir, tmp_path / "zinf", zinf=True)
    assert (ddp["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "accelerate_zinf.accelerator")
    assert len(ours["losses"]) == 8
    assert_close(ddp["losses"], ours["losses"], FP32_RTOL)

    # only the adapter trains: LoRA A and B of q_proj (64 -> 64) and v_proj (64 -> 32) in 2 layers, r=8
    assert ours["trainable"] == ddp["trainable"] == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert ours["total"] == ddp["total"]
    # with the adapter disabled the model is the pretrained one: the frozen base weights did not move
    # (measured: bit-identical to the pretrained model's logits in both runs)
    assert ours["base_logits"] == ddp["base_logits"]
    assert torch.allclose(torch.tensor(ours["base_logits"]), reference_logits(model_dir), rtol=0, atol=1e-6)
    # ... and the trained adapter changed the model's answer, as it did under DDP
    tuned, base = torch.tensor(ours["tuned_logits"]), torch.tensor(ours["base_logits"])
    assert (tuned - base).abs().max() > 1e-2
    assert torch.allclose(tuned, torch.tensor(ddp["tuned_logits"]), rtol=0, atol=1e-5)

    # each rank completed its own prompt and stopped after a different number of tokens (so generate ran in
    # lockstep on zinf: [Note: generate in lockstep] in accelerate_zinf/generation.py), as under DDP
    assert ours["generated"] == ddp["generated"]
    prompts = [len(p.split()) for p in _script().PROMPTS]
    new_tokens = [len(seq) - n for seq, n in zip(ddp["generated"], prompts)]
    assert new_tokens[0] != new_tokens[1], new_tokens

    # Trainer's default saving wrote the final checkpoint: the same adapter as DDP's (zinf gathered only the adapter;
    # its optimizer state is in zinf's shards, not optimizer.pt) (measured: within 1.4e-6, after 8 Adam steps at lr 1e-2)
    from safetensors.torch import load_file

    ddp_dir, our_dir = (tmp_path / run / "output" / "checkpoint-8" for run in ("ddp", "zinf"))
    assert {"optimizer.pt", "adapter_model.safetensors"} <= {p.name for p in ddp_dir.iterdir()}
    assert not (our_dir / "optimizer.pt").exists() and (our_dir / "zinf" / "commit.json").is_file()
    ddp_adapter, our_adapter = (load_file(d / "adapter_model.safetensors") for d in (ddp_dir, our_dir))
    assert ddp_adapter.keys() == our_adapter.keys() and len(ddp_adapter) == 8
    for k, v in ddp_adapter.items():
        assert torch.allclose(v, our_adapter[k], rtol=0, atol=5e-6), k
