"""[Note: compiled modules] in zinf/schedule/hooks.py: blocks compiled with ``torch.compile`` (each block, or the whole
model) train under zinf as the same compiled model trains under plain PyTorch with the global batch, on 1 and 2 gloo
ranks with the CPU's inductor backend; dynamo compiles from the second step on and never recompiles after it, with
parameters in memory, the optimizer on CPU, and parameters and optimizer on NVMe."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import llama_config, token_batches
from training import lm_step_global

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # inductor compiles for tens of seconds

STEPS = 6
BATCH = 4


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


BUILD = {"gpt2": _gpt2, "llama": _llama}


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "transformer", None) or model.model
    return list(inner.h if hasattr(inner, "h") else inner.layers)


def _compile(model: torch.nn.Module, what: str) -> None:
    if what == "blocks":
        for block in _blocks(model):
            block.compile()
    else:
        model.compile()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _train(rank: int, world: int, kind: str, what: str, config: dict | None, nvme: str = "") -> dict[str, Any]:
    """``config`` None: plain PyTorch on the global batch (one process); else zinf on this rank's slice."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    settings = dict(config or {})
    if nvme and "offload" in settings:
        settings["offload"] = {**settings["offload"], "nvme_paths": [nvme]}
    engine = None
    if config is None:
        model = BUILD[kind]()
    else:
        with zinf.Init(settings):
            model = BUILD[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if config is not None:
        engine = zinf.initialize(model, opt, settings)
    _compile(model, what)
    losses, graphs = [], []
    for ids in token_batches(STEPS, BATCH, seq=16):
        if engine is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        else:
            losses.append(lm_step_global(engine, ids, rank, world))
        graphs.append(_graphs())
    if engine is not None:
        engine.close()
    return {"losses": losses, "graphs": graphs}


def _check(kind: str, what: str, world: int, config: dict, nvme: str = "") -> None:
    plain = run_distributed(_train, 1, kind, what, None)[0]
    results = run_distributed(_train, world, kind, what, config, nvme)
    for rank, result in enumerate(results):
        for step, (a, b) in enumerate(zip(plain["losses"], result["losses"])):
            assert abs(a - b) <= 1e-5 * abs(a), (rank, step, plain["losses"], result["losses"])
        graphs = result["graphs"]
        assert graphs[1] > 0, f"rank {rank}: nothing compiled ({graphs})"
        assert graphs[1:] == [graphs[1]] * (STEPS - 1), f"rank {rank}: dynamo compiled again after step 2: {graphs}"


@pytest.mark.parametrize("what", ["blocks", "model"])
def test_compiled_gpt2_trains_as_plain_compiled(what: str) -> None:
    _check("gpt2", what, 2, {})


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("what", ["blocks", "model"])
def test_compiled_llama_trains_as_plain_compiled(world: int, what: str) -> None:
    _check("llama", what, world, {})


@pytest.mark.parametrize("placement", ["optimizer_cpu", "nvme"])
def test_compiled_blocks_with_offload(placement: str, tmp_path: Any) -> None:
    offload = {"optimizer": "cpu"} if placement == "optimizer_cpu" else {"params": "nvme", "optimizer": "nvme"}
    _check("gpt2", "blocks", 2, {"offload": offload}, nvme=str(tmp_path))
