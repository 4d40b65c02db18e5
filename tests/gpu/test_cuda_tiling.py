"""Tiling and checkpointing with host-held inputs on CUDA: same losses as without, and the device memory
they are for (``torch.cuda`` statistics). Skipped without a GPU; what has run on a GPU: docs/gpu.md."""

from __future__ import annotations

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, batches, make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(rank: int, world: int, settings: dict) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict(settings)
    with zinf.Init(config):
        model = GPT(GPTConfig(n_layer=4, block=64, n_embd=128))
    engine = zinf.initialize(model, make_optimizer(model), config)
    losses, held = [], 0
    for x, y in batches("gpt", 6, 8):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = engine(x.cuda(), y.cuda())
        torch.cuda.synchronize()
        held = max(held, torch.cuda.memory_allocated() - before)  # device bytes kept for backward
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = engine.report().peak_gathered_bytes
    engine.close()
    return {"losses": losses, "held": held, "peak": peak}


def test_tiling_and_offloaded_checkpoints_on_cuda() -> None:
    off = run_distributed(_run, 1, {}, backend="nccl")[0]
    tiled = run_distributed(_run, 1, {"tiling": {"min_numel": 10000, "tiles": [2, 2]}}, backend="nccl")[0]
    ckpt = run_distributed(_run, 1, {"activation_checkpointing": {"modules": ["Block"]}}, backend="nccl")[0]
    host = run_distributed(_run, 1, {"activation_checkpointing": {"modules": ["Block"], "offload": True}},
                           backend="nccl")[0]
    for run in (tiled, ckpt, host):
        assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], off["losses"])) < 1e-5
    assert host["held"] < ckpt["held"] < off["held"]
