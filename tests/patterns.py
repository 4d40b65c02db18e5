"""Model patterns real training brings, each with its own data and the call that turns a batch into a loss.

Every pattern is trained twice by tests/distributed/test_model_patterns.py: in one plain PyTorch
process on the whole global batch, and by zinf on N ranks, each on its slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import GPT, Block, GPTConfig


# -- activation checkpointing -------------------------------------------------------------------------
class CheckpointedBlock(Block):
    """A block whose attention is checkpointed inside (with the whole block checkpointed too: nested)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + checkpoint(self.attn, self.ln1(x), use_reentrant=False)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CheckpointedGPT(GPT):
    def __init__(self, cfg: GPTConfig, mode: str) -> None:
        self.mode = mode
        super().__init__(cfg)
        if mode == "nested":
            self.blocks = nn.ModuleList([CheckpointedBlock(cfg) for _ in range(cfg.n_layer)])
            self.apply(self._init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# -- branches: modules skipped on every rank in some steps, or on some ranks only ----------------------
class Branchy(nn.Module):
    """``rare`` runs only for rows whose first feature is large (on some steps only on some ranks, on
    others nowhere); ``dropped`` is left out of every third step on every rank."""

    def __init__(self, dim: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.rare = nn.Linear(dim, dim)
        self.dropped = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.inp(x))
        mask = x[:, 0] > 2.5
        if bool(mask.any()):
            h = h.clone()
            h[mask] = h[mask] + torch.tanh(self.rare(h[mask]))
        if self.calls % 3 != 0:
            h = h + torch.tanh(self.dropped(h))
        h = torch.tanh(self.mid(h))
        return F.cross_entropy(self.head(h), y)


def branchy_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Even steps: only the first row has the rare feature (so only rank 0 runs ``rare``); odd: none."""
    g = torch.Generator().manual_seed(99)
    out = []
    for s in range(steps):
        x = torch.randn(batch, 12, generator=g).clamp(-2, 2)
        if s % 2 == 0:
            x[0, 0] = 3.0
        out.append((x, torch.randint(0, 5, (batch,), generator=g)))
    return out


# -- outputs that are not tensors ---------------------------------------------------------------------
@dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: torch.Tensor
    note: str = "plain dataclass"


class PairOut(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


class _OwnLinear(nn.Module):
    """Holds its weights directly (no child modules): only its own output can announce its backward."""

    def __init__(self, dim: int, out: int | None = None) -> None:
        super().__init__()
        lin = nn.Linear(dim, out or dim)
        self.weight, self.bias = lin.weight, lin.bias

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DataclassBlock(_OwnLinear):
    def forward(self, x: torch.Tensor) -> BlockOut:
        h = torch.tanh(self.linear(x))
        return BlockOut(hidden=h, aux=h.square().mean(dim=-1))


class NamedTupleBlock(_OwnLinear):
    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim + 1)

    def forward(self, x: torch.Tensor) -> PairOut:
        h = self.linear(x)
        return PairOut(torch.tanh(h[:, :-1]), torch.sigmoid(h[:, -1:]))


class NestedOutBlock(_OwnLinear):
    """Returns a dict holding a list holding a dataclass."""

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.linear(x))
        return {"outs": [BlockOut(hidden=h, aux=h.mean(dim=-1))]}


class OddOutputs(nn.Module):
    def __init__(self, dim: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.a = DataclassBlock(dim)
        self.b = NamedTupleBlock(dim)
        self.c = NestedOutBlock(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.a(torch.tanh(self.inp(x)))
        pair = self.b(out.hidden)
        h = self.c(pair.hidden * pair.gate)["outs"][0].hidden
        return F.cross_entropy(self.head(h), y) + 0.1 * out.aux.mean()


# -- mixture of experts ---------------------------------------------------------------------------------
class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Top-1 routing: each expert runs only on the tokens routed to it, so which experts run depends on
    each rank's data."""

    def __init__(self, dim: int, num_experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(dim=-1)
        gate, choice = probs.max(dim=-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel():
                y = y.index_add(0, rows, expert(x[rows]) * gate[rows, None])
        return y.reshape(shape)


class MoEBlock(Block):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        del self.fc, self.out
        self.moe = MoE(cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(GPT):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList([MoEBlock(cfg) for _ in range(cfg.n_layer)])
        self.apply(self._init_weights)
        for e in self.modules():  # a router that picks clearly: routing varies from rank to rank
            if isinstance(e, MoE):
                nn.init.normal_(e.router.weight, std=1.0)


# -- transformers models ----------------------------------------------------------------------------
def switch_transformers() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    cfg = SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=8,
        expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0, dropout_rate=0.0,
        router_z_loss_coef=0.0, router_aux_loss_coef=0.0, decoder_start_token_id=0, pad_token_id=0,
        tie_word_embeddings=False)
    return SwitchTransformersForConditionalGeneration(cfg)


def llama_checkpointed() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def token_batches(steps: int, batch: int, vocab: int, length: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(1, vocab, (batch, length + 1), generator=g)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


# -- the recipe -----------------------------------------------------------------------------------------
def _loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)


def _hf_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=y).loss


@dataclass
class Pattern:
    build: Callable[[], nn.Module]
    data: Callable[[int, int], list[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] = _loss
    steps: int = 8
    batch: int = 8
    freeze: tuple[str, ...] = ()  # parameter name prefixes made requires_grad=False (still given to the optimizer)
    zinf: dict[str, Any] = field(default_factory=dict)


def _gpt_data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(steps, batch, GPTConfig().vocab, GPTConfig().block)


def _moe_data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(steps, batch, GPTConfig().vocab, 8)


def _float_data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)]


NVME_DIR = "{nvme_dir}"  # a pattern's NVMe directory: the test's own tmp_path, filled in by zinf_settings


def zinf_settings(pattern: Pattern, nvme_dir: str) -> dict[str, Any]:
    """The pattern's zinf settings with its NVMe directory placed under ``nvme_dir`` (a test's tmp_path)."""
    offload = dict(pattern.zinf.get("offload", {}))
    if "nvme_paths" in offload:
        offload["nvme_paths"] = [p.replace(NVME_DIR, nvme_dir) for p in offload["nvme_paths"]]
    return {**pattern.zinf, **({"offload": offload} if offload else {})}


PATTERNS: dict[str, Pattern] = {
    "checkpoint_nonreentrant": Pattern(lambda: CheckpointedGPT(GPTConfig(), "nonreentrant"), _gpt_data),
    "checkpoint_reentrant": Pattern(lambda: CheckpointedGPT(GPTConfig(), "reentrant"), _gpt_data),
    "checkpoint_nested": Pattern(lambda: CheckpointedGPT(GPTConfig(), "nested"), _gpt_data),
    "frozen_in_optimizer": Pattern(lambda: GPT(GPTConfig()), _gpt_data, freeze=("wte.", "blocks.0.")),
    "skipped_branches": Pattern(Branchy, branchy_batches),
    # the offloaded CPU-Adam keeps torch's semantics too: frozen and gradient-less parameters are not stepped
    "frozen_offload_cpu": Pattern(lambda: GPT(GPTConfig()), _gpt_data, freeze=("wte.", "blocks.0."),
                                  zinf={"offload": {"optimizer": "cpu"}}),
    "skipped_branches_offload_nvme": Pattern(Branchy, branchy_batches, zinf={"offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_paths": [NVME_DIR],
        "pinned_pool_bytes": 8 << 20, "sub_group_numel": 4096}}),
    "dataclass_namedtuple_outputs": Pattern(OddOutputs, _float_data),
    # module by module (unit_policy="modules"): the routing makes the ranks' gathers differ and zinf adopts units
    "checkpoint_nonreentrant_modules": Pattern(lambda: CheckpointedGPT(GPTConfig(), "nonreentrant"), _gpt_data,
                                               zinf={"unit_policy": "modules"}),
    "moe_auto": Pattern(lambda: MoEGPT(GPTConfig()), _moe_data, zinf={"unit_policy": "modules"}),
    "moe_unit": Pattern(lambda: MoEGPT(GPTConfig()), _moe_data, zinf={"unit_modules": ["MoE"]}),
    # the default policy gathers each block (MoE layer inside) as one unit: the ranks' gathers never differ
    "moe_blocks": Pattern(lambda: MoEGPT(GPTConfig()), _moe_data),
    # one block is no stack: each expert (a ModuleList of one class) is a unit, and the MoE layer around them is
    # adopted when the routing differs
    "moe_one_block": Pattern(lambda: MoEGPT(GPTConfig(n_layer=1)), _moe_data),
    "hf_switch_transformers_moe": Pattern(switch_transformers, lambda s, b: token_batches(s, b, 64, 6), _hf_loss,
                                          zinf={"unit_policy": "modules"}),
    "hf_switch_transformers_moe_unit": Pattern(switch_transformers, lambda s, b: token_batches(s, b, 64, 6), _hf_loss,
                                               zinf={"unit_modules": ["SwitchTransformersExperts"]}),
    "hf_switch_transformers_moe_blocks": Pattern(switch_transformers, lambda s, b: token_batches(s, b, 64, 6),
                                                 _hf_loss),
    "hf_llama_gradient_checkpointing": Pattern(llama_checkpointed, lambda s, b: token_batches(s, b, 64, 8), _hf_loss),
}


def build(pattern: Pattern) -> nn.Module:
    model = pattern.build()
    for name, p in model.named_parameters():
        if name.startswith(pattern.freeze):
            p.requires_grad_(False)
    return model
