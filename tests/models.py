"""Small models the tests train: built from configs, with their own data; nothing is downloaded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 96
    block: int = 16
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    functional_head: bool = False  # True: the root reads wte.weight itself (a parameter used outside its module)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style: tied input/output embeddings, a positional table owned by the root, and a
    post-construction initialisation pass that rewrites the children's weights (as HF models do)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Parameter(torch.zeros(cfg.block, cfg.n_embd))
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        if not cfg.functional_head:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        nn.init.normal_(self.wpe, std=0.01)
        for name, p in self.named_parameters():
            if name.endswith("out.weight"):
                p.data.normal_(mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe[:t]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.cfg.functional_head else self.lm_head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class CNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)).float(), y)


class Twice(nn.Module):
    """One module (``shared``) called twice per step."""

    def __init__(self, dim: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.shared = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h)) + h
        return F.cross_entropy(self.head(h).float(), y)


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig())
    if kind == "gpt_functional":
        return GPT(GPTConfig(functional_head=True))
    if kind == "gpt_vocab":  # its embedding outweighs a block: with parameters on NVMe its blocks are units too
        return GPT(GPTConfig(vocab=2048))
    if kind == "cnn":
        return CNN()
    if kind == "twice":
        return Twice()
    raise ValueError(kind)


def batches(kind: str, steps: int, batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of (input, target) global batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind.startswith("gpt"):
            cfg = GPTConfig()
            idx = torch.randint(0, cfg.vocab, (batch, cfg.block + 1), generator=g)
            out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
        elif kind == "cnn":
            out.append((torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        elif kind == "llama":  # token ids, inputs and labels of llama_config()'s causal LM
            ids = torch.randint(0, 96, (batch, 16), generator=g)
            out.append((ids, ids))
        else:
            out.append((torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)))
    return out


def make_optimizer(model: nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    if name == "adam":
        return torch.optim.Adam(groups, lr=3e-3)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    raise ValueError(name)


class Switch(nn.Module):
    """Runs its layers forwards or, once ``reverse`` is set (on every rank alike), backwards: the module
    order changes mid-training and the recorded trace must be dropped and recorded again."""

    def __init__(self, dim: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(4)])
        self.head = nn.Linear(dim, classes)
        self.reverse = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers) if self.reverse else self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x), y)


def llama_config(tied: bool = False):
    """A tiny Llama (about 51k parameters) for the pretrained-weights tests; transformers is imported lazily."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)


def save_llama(path, tied: bool = False, seed: int = 3, max_shard_size: str = "60KB"):
    """``save_pretrained`` a tiny Llama seeded with ``seed`` into ``path`` (several shards and an index by default)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(llama_config(tied)).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def token_batches(steps: int, batch: int, seq: int = 16, vocab: int = 96, seed: int = 7) -> list[torch.Tensor]:
    """A fixed list of global batches of token ids (inputs and labels of a causal LM)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]
