"""accelerate_zinf.generation in one process: which modules get a lockstep generate, and how it is undone.
(Two ranks generating prompts of different lengths on zinf: tests/adapters/test_trl_peft.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from accelerate_zinf.generation import LockstepGenerate  # noqa: E402


class Wrapper(nn.Module):  # a PeftModel-like parent that is not a transformers model itself
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, eos_token_id=None,
                                        pad_token_id=0)).eval()


def test_transformers_models_inside_generate_in_lockstep_until_removed() -> None:
    assert not torch.distributed.is_initialized()
    llama = _llama()
    ids = torch.tensor([[1, 2, 3]])
    plain = llama.generate(ids, max_new_tokens=3, do_sample=False)
    lockstep = LockstepGenerate(Wrapper(llama), world=2)
    assert "generate" in llama.__dict__
    # synced_gpus=True by default: it asks the other ranks whether they are done (here: no process group)
    with pytest.raises(ValueError, match="process group"):
        llama.generate(ids, max_new_tokens=3, do_sample=False)
    # an explicit choice is kept
    assert torch.equal(llama.generate(ids, max_new_tokens=3, do_sample=False, synced_gpus=False), plain)
    lockstep.remove()
    assert "generate" not in llama.__dict__
    assert torch.equal(llama.generate(ids, max_new_tokens=3, do_sample=False), plain)


def test_one_rank_leaves_generate_alone() -> None:
    llama = _llama()
    LockstepGenerate(llama, world=1)
    assert "generate" not in llama.__dict__
