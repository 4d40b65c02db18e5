"""Frozen linear layers computed from their 16-bit stored weights in tiles ([Note: frozen linears from storage] in
zinf/frozen_linear.py), on 1 and 2 gloo ranks, the parameters in memory and on NVMe: a LoRA-shaped model (frozen
base layers with biases, trainable adapters, odd widths, several tiles a layer with a short last one) gives the
losses and gradient norms of the same run with the base widened whole (``frozen_tile_bytes: 0``) within fp32
rounding, step after step; the frozen base is gathered at its storage width (half the bytes), the adapters as
before. The learning rate is 0: a weight differing in its last fp32 bit may round to another bf16 value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zinf
from dist_utils import run_distributed
from zinf.param.registry import group_of

pytestmark = pytest.mark.distributed

LAYERS, WIDTH, STEPS = 3, 70, 3
TILE_BYTES = 16 * WIDTH * 4  # 16 rows a tile: 70 outputs in 5 tiles, the last of 6


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, 3, bias=False)
        self.up = nn.Linear(3, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


def _train(rank: int, world: int, tile_bytes: int, nvme: str | None) -> dict:
    offload = {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 1 << 20} if nvme else {}
    config = zinf.ZeroConfig.from_dict({"param_storage": "bf16", "tiling": {"frozen_tile_bytes": tile_bytes},
                                        "offload": offload})
    torch.manual_seed(0)
    with zinf.Init(config):
        model = nn.Sequential(*[Adapted() for _ in range(LAYERS)], nn.Linear(WIDTH, 1))
    for block in model[:LAYERS]:
        block.base.requires_grad_(False)
    engine = zinf.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0),
                             config)
    dtypes: dict[str, torch.dtype] = {}

    def seen(name: str):  # a pre-hook returning something would replace the layer's input
        return lambda mod, args: dtypes.setdefault(name, mod.weight.dtype) and None

    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            m.register_forward_pre_hook(seen(name))
    switched = sorted(n for n, m in model.named_modules() if m in engine.from_storage)
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        x = torch.randn(4 * world, 5, WIDTH, generator=g)
        loss = engine(x.chunk(world)[rank]).pow(2).mean()
        engine.backward(loss)
        norms.append(float(engine.clip_grad_norm_(1e9)))
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    full_dtypes = {n: group_of(m.weight).full.dtype for n, m in model.named_modules() if type(m) is nn.Linear}
    engine.close()
    return {"losses": losses, "norms": norms, "switched": switched, "dtypes": dtypes, "full": full_dtypes}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("nvme", [False, True], ids=["memory", "nvme"])
def test_tiles_from_storage_train_as_the_widened_base(world: int, nvme: bool, tmp_path: Path) -> None:
    path = str(tmp_path) if nvme else None
    tiled = run_distributed(_train, world, TILE_BYTES, path)[0]
    widened = run_distributed(_train, world, 0, path)[0]
    bases = [f"{i}.base" for i in range(LAYERS)]
    assert tiled["switched"] == bases and widened["switched"] == []
    assert all(tiled["dtypes"][b] == torch.bfloat16 and tiled["full"][b] == torch.bfloat16 for b in bases)
    assert all(widened["dtypes"][b] == torch.float32 for b in bases)
    trained = [n for n in tiled["dtypes"] if n not in bases]
    assert trained and all(tiled["dtypes"][n] == torch.float32 for n in trained)
    for key in ("losses", "norms"):
        rel = max(abs(a - b) / abs(b) for a, b in zip(tiled[key], widened[key]))
        assert rel <= 1e-6, (key, tiled[key], widened[key])
    assert len(set(tiled["losses"])) == STEPS  # every step a batch of its own


# -- a quantized base: the layers decode their codes tile by tile -------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    # hidden 64: q/k/v/o and gate/up take 64 inputs, whole 4-bit blocks a row; down_proj takes 96 (1.5 blocks a row):
    # left widened in 4 bits, in tiles in 8 bits. gate_proj's 96 rows on 2 ranks: 48 a rank, a 32-row tile across
    path = tmp_path_factory.mktemp("llama_tiles")
    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
                     ).save_pretrained(path)
    return path


def _quantized(rank: int, world: int, path: str, nvme: str | None, bits: int, tile_bytes: int) -> dict:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
           if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))
    if nvme:
        os.makedirs(nvme, exist_ok=True)
    offload = {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 1 << 20} if nvme else {}
    config = zinf.ZeroConfig.from_dict({"precision": "fp32", "offload": offload,
                                        "tiling": {"frozen_tile_bytes": tile_bytes}})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=bnb)
    model.requires_grad_(False)
    engine = zinf.initialize(model, None, config)
    embedded: list[torch.Tensor] = []

    def leaf(module, args, out):  # the embeddings as a leaf: its gradient passes back through every layer's tiles
        embedded.append(out.detach().requires_grad_())
        return embedded[-1]

    model.get_input_embeddings().register_forward_hook(leaf)
    ids = torch.randint(0, 80, (2, 9), generator=torch.Generator().manual_seed(rank))
    with engine.backward_scope():
        logits = engine(input_ids=ids).logits
        logits.pow(2).mean().backward()
    weight = model.model.layers[1].mlp.gate_proj.weight
    with zinf.GatheredParameters(weight):
        gathered = weight.detach().clone()
    out = {"logits": logits.detach(), "grad": embedded[0].grad, "gate": gathered,
           "switched": sorted(n for n, m in model.named_modules() if m in engine.from_storage),
           "packed": sum(g.packed for g in engine.groups)}
    engine.close()
    return out


@pytest.mark.parametrize("world,bits,nvme", [(2, 4, True), (2, 8, False), (1, 4, False)])
def test_a_quantized_base_decoded_in_tiles_computes_as_decoded_whole(llama: Path, tmp_path: Path, world: int,
                                                                     bits: int, nvme: bool) -> None:
    pytest.importorskip("bitsandbytes")
    path = str(tmp_path / "nvme") if nvme else None
    tiled = run_distributed(_quantized, world, str(llama), path, bits, 32 * 64 * 4)
    whole = run_distributed(_quantized, world, str(llama), path, bits, 0)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"] + ([] if bits == 4 else ["down_proj"])
    want = sorted(f"model.layers.{i}.{'self_attn' if n.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{n}"
                  for i in range(2) for n in names)
    for t, w in zip(tiled, whole):
        assert t["switched"] == want and w["switched"] == [] and t["packed"] == len(want) and w["packed"] == 0
        assert torch.equal(t["gate"], w["gate"])  # read outside the layer: decoded whole, the same bits
        assert float((t["logits"] - w["logits"]).abs().max()) <= 1e-6 * float(w["logits"].abs().max())
        assert float((t["grad"] - w["grad"]).abs().max()) <= 1e-5 * float(w["grad"].abs().max())
