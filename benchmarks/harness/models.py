"""The models the benchmarks train, built from configs (nothing is downloaded): the GPT of examples/gpt.py
("gpt"), transformers' GPT-2 ("gpt2") and Llama ("llama"), at named sizes; their loss and their FLOPs.

A model is named ``family:size`` (``gpt:small``) or ``family:size:L<n_layer>`` to change the depth only
(the size curve's ladder: ``gpt:xl:L8``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
FAMILIES = ("gpt", "gpt2", "llama")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    family: str
    size: str
    n_embd: int
    n_layer: int
    n_head: int
    vocab: int
    block: int  # sequence length trained on

    @property
    def name(self) -> str:
        return f"{self.family}:{self.size}"


# n_embd, n_layer, n_head, vocab, block
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 512, 32),  # smoke runs
    "host": (16, 12, 2, 128, 8),  # a real module tree at negligible width: a step is host work alone
    "small": (256, 6, 4, 8192, 128),  # ~7M parameters
    "medium": (512, 8, 8, 16384, 256),  # ~34M
    "large": (1024, 12, 16, 32768, 256),  # ~185M
    "xl": (2048, 24, 16, 32768, 256),  # ~1.3B; the size curve's ladder varies its depth
}


def parse(name: str) -> ModelSpec:
    """``family:size`` or ``family:size:L<n_layer>``; an unknown part is an error that lists the choices."""
    parts = name.split(":")
    if len(parts) not in (2, 3) or parts[0] not in FAMILIES or parts[1] not in SIZES:
        raise SystemExit(f"model '{name}': expected FAMILY:SIZE[:L<layers>] with FAMILY one of {list(FAMILIES)} "
                         f"and SIZE one of {list(SIZES)}, e.g. gpt:small or gpt:xl:L8")
    n_embd, n_layer, n_head, vocab, block = SIZES[parts[1]]
    spec = ModelSpec(family=parts[0], size=parts[1], n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab=vocab,
                     block=block)
    if len(parts) == 3:
        if not (parts[2].startswith("L") and parts[2][1:].isdigit() and int(parts[2][1:]) > 0):
            raise SystemExit(f"model '{name}': the third part sets the depth, e.g. L8 (found '{parts[2]}')")
        spec = replace(spec, size=f"{parts[1]}:{parts[2]}", n_layer=int(parts[2][1:]))
    return spec


def import_model_code(spec: ModelSpec) -> None:
    """Import the model's code (and what it imports, torch._dynamo among it) now: a construction context that
    patches torch (deepspeed.zero.Init patches Tensor.__new__) must not be active while those modules load."""
    if spec.family == "gpt":
        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        import gpt  # noqa: F401
    elif spec.family == "gpt2":
        from transformers import GPT2LMHeadModel  # noqa: F401
    else:
        from transformers import LlamaForCausalLM  # noqa: F401
    import torch._dynamo  # noqa: F401


def build(spec: ModelSpec) -> nn.Module:
    """The model, built in the current device / init context (zinf.Init, deepspeed.zero.Init, meta)."""
    if spec.family == "gpt":
        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        from gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab=spec.vocab, block=spec.block, n_embd=spec.n_embd, n_head=spec.n_head,
                             n_layer=spec.n_layer))
    if spec.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=spec.vocab, n_positions=spec.block, n_embd=spec.n_embd, n_layer=spec.n_layer,
                         n_head=spec.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                         bos_token_id=spec.vocab - 1, eos_token_id=spec.vocab - 1, attn_implementation="sdpa")
        return GPT2LMHeadModel(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = (8 * spec.n_embd // 3 + 63) // 64 * 64  # SwiGLU width, rounded up to 64
    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.n_embd, intermediate_size=hidden,
                      num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.n_head,
                      max_position_embeddings=spec.block, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def blocks(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The transformer blocks (FSDP2 shards each one, then the root)."""
    if spec.family == "gpt":
        return list(model.blocks)
    if spec.family == "gpt2":
        return list(model.transformer.h)
    return list(model.model.layers)


def loss_fn(spec: ModelSpec) -> Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(call, idx, targets)`` where ``call`` is the model, its DDP/FSDP2 wrapper or an engine."""
    if spec.family == "gpt":
        return lambda call, idx, tgt: call(idx, tgt)

    def hf_loss(call: Callable, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = call(input_ids=idx).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())

    return hf_loss


def batch(spec: ModelSpec, global_batch: int, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch: every system and rank count sees the same global data
    (token sequences where each token predicts the next by a per-row rule)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, spec.vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (global_batch, 1), generator=g)
    seq = (start + stride * torch.arange(spec.block + 1)) % spec.vocab
    rows = global_batch // world
    seq = seq[rank * rows:(rank + 1) * rows]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


@dataclass(frozen=True)
class ModelCounts:
    numel: int  # distinct parameters
    matmul_numel: int  # weights of the matrix multiplies (a tied head counts again: it is a matmul too)
    flops_per_token: float  # forward + backward


def counts(spec: ModelSpec) -> ModelCounts:
    """Counted on the meta device (no memory). FLOPs per token trained, forward and backward: 6 per matmul weight
    plus 12 * n_layer * block * n_embd for attention's two products (the convention of the PaLM paper's
    appendix B; causal masking is not discounted), so achieved FLOP/s compare across systems and sizes."""
    with torch.device("meta"):
        model = build(spec)
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    matmul = 0
    for m in model.modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":  # transformers' GPT-2 uses Conv1D
            matmul += m.weight.numel()
    flops = 6.0 * matmul + 12.0 * spec.n_layer * spec.block * spec.n_embd
    return ModelCounts(numel=numel, matmul_numel=matmul, flops_per_token=flops)
