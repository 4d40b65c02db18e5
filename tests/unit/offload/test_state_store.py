"""The CPU optimizer's states in host memory: one fp32 master where the parameter shard is one already
([Note: one fp32 master on the host] in zinf/offload/state_store.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zinf


def _train(params: str, optimizer: str, early: bool = False,
           storage: str = "fp32") -> tuple[dict[str, dict[str, int]], int, list[float]]:
    cfg = zinf.ZeroConfig.from_dict({"optimizer_storage": storage, "offload": {
        "params": params, "optimizer": optimizer, "step_during_backward": early}})
    torch.manual_seed(0)
    with zinf.Init(cfg):
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    numel = sum(p.numel() for p in model.parameters())
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    torch.manual_seed(1)
    losses = []
    for _ in range(4):
        loss = engine(torch.randn(8, 64)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.synchronize()
    held = engine.resident_bytes()
    engine.close()
    return held, numel, losses


@pytest.mark.parametrize("params", ["device", "cpu"])
def test_fp32_parameters_and_optimizer_in_host_memory_take_16_bytes_each(params: str) -> None:
    held, numel, losses = _train(params, "cpu")
    cpu = held["cpu"]
    per = {k: v / numel for k, v in cpu.items() if v}
    assert per == {"param_shards": 4.0, "grad_shards": 4.0, "optimizer_state": 8.0}, per
    # the master stepped in place is the shard the forward reads: the losses are the separate master's
    assert losses == _train(params, "cpu", early=True)[2]


def test_steps_during_the_backward_keep_a_master_of_their_own() -> None:
    """An early step writes the master before the step after the backward has checked it: not the shard."""
    held, numel, _ = _train("cpu", "cpu", early=True)
    assert held["cpu"]["optimizer_state"] == 12 * numel


@pytest.mark.parametrize("params", ["device", "cpu"])
def test_bf16_moments_take_12_bytes_each(params: str) -> None:
    """``optimizer_storage: bf16``: shard and master 4, moments 2 + 2, gradient 4 (the engine's own account)."""
    held, numel, _ = _train(params, "cpu", storage="bf16")
    per = {k: v / numel for k, v in held["cpu"].items() if v}
    assert per == {"param_shards": 4.0, "grad_shards": 4.0, "optimizer_state": 4.0}, per
    held, numel, _ = _train("cpu", "cpu", early=True, storage="bf16")
    assert held["cpu"]["optimizer_state"] == 8 * numel  # a master of its own, 4, and the moments


def test_bf16_moments_on_nvme_take_half_the_records(tmp_path) -> None:
    cfgs = {s: zinf.ZeroConfig.from_dict({"optimizer_storage": s, "offload": {
        "params": "cpu", "optimizer": "nvme", "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 4 << 20}})
        for s in ("fp32", "bf16")}
    held = {}
    for storage, cfg in cfgs.items():
        torch.manual_seed(0)
        with zinf.Init(cfg):
            model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
        held[storage] = engine.resident_bytes()["nvme"]["optimizer_state"]
        numel = sum(g.shard_numel for g in engine.groups)
        engine.close()
    assert (held["fp32"], held["bf16"]) == (12 * numel, 8 * numel), held


def test_int8_moments_take_at_most_10_1_bytes_each() -> None:
    """``optimizer_storage: int8``: a byte per moment and an exponent byte per 256 elements of each."""
    held, numel, losses = _train("cpu", "cpu", storage="int8")
    per = {k: v / numel for k, v in held["cpu"].items() if v}
    assert per["param_shards"] == 4.0 and per["grad_shards"] == 4.0 and 2.0 < per["optimizer_state"] <= 2.1, per
    assert sum(per.values()) <= 10.1


@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_compact_moments_step_alike_during_the_backward(storage: str) -> None:
    """``step_during_backward`` takes the same steps with compact moments (the same rounding bits, the block
    exponents backed up and rolled back with the codes)."""
    assert _train("cpu", "cpu", storage=storage)[2] == _train("cpu", "cpu", early=True, storage=storage)[2]
