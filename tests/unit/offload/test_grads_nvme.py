"""Gradient shards on NVMe give exactly the numbers of gradient shards in memory, and leave memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.param.grad_shard import GradState


def _run(tmp_path: Path, grads: str, precision: str = "fp32", accumulate: int = 2) -> tuple[list[float], zinf.ZeroInfinityEngine]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({
        "precision": precision, "gradient_clipping": 0.5,
        "offload": {"params": "nvme", "optimizer": "nvme", "grads": grads, "nvme_paths": [str(tmp_path)],
                    "sub_group_numel": 4096, "pinned_pool_bytes": 8 << 20}})
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        for _ in range(accumulate):
            x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    return losses, engine


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nvme_gradients_match_gradients_in_memory(precision: str, tmp_path: Path) -> None:
    # accumulation reads a stashed shard back; clipping (and fp16 unscaling) are deferred to the step
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    on_disk, engine = _run(tmp_path / "a", "nvme", precision)
    engine.close()
    in_memory, engine = _run(tmp_path / "b", "cpu", precision)
    engine.close()
    assert on_disk == in_memory


def test_nvme_gradients_leave_host_memory(tmp_path: Path) -> None:
    _, engine = _run(tmp_path, "nvme", accumulate=1)
    engine.synchronize()
    x = torch.randn(8, 64)
    engine.backward(engine(x).square().mean())
    assert all(g.grad.resident is None and g.grad.state is GradState.ON_NVME for g in engine.groups)
    assert "grad_shards" not in engine.resident_bytes().get("cpu", {})
    assert engine.resident_bytes()["nvme"]["grad_shards"] == sum(g.shard_numel * 4 for g in engine.groups)
    engine.close()


def test_nvme_gradients_need_the_nvme_optimizer() -> None:
    with pytest.raises(zinf.ConfigError, match=r"offload.grads.*'nvme' only with offload.optimizer='nvme'"):
        zinf.ZeroConfig.from_dict({"offload": {"optimizer": "cpu", "grads": "nvme"}})


def _grads_auto(tmp_path: Path, max_cpu_bytes: int) -> tuple[str, dict[str, dict[str, int]], int]:
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "nvme", "optimizer": "nvme", "grads": "auto", "nvme_paths": [str(tmp_path)],
        "pinned_pool_bytes": 8 << 20, "max_cpu_bytes": max_cpu_bytes}})
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    engine.backward(engine(torch.randn(8, 64)).square().mean())
    engine.step()
    engine.synchronize()
    engine.backward(engine(torch.randn(8, 64)).square().mean())  # the gradients wait for the step now
    tier, held = engine.placement.grads_tier, engine.resident_bytes()
    numel = sum(g.shard_numel for g in engine.groups)
    engine.close()
    return tier, held, numel


def test_auto_keeps_gradients_on_the_host_where_they_fit(tmp_path: Path) -> None:
    """[Note: gradients on the host] in zinf/placement.py: within ``max_cpu_bytes`` (the pool and the gradient shards
    here) the gradients stay in host memory and cost no NVMe bytes; a byte less and they go to NVMe. Without a
    budget, half the free memory decides (ample here)."""
    tier, held, numel = _grads_auto(tmp_path, 0)
    assert tier == "cpu" and held["cpu"]["grad_shards"] == numel * 4 and "grad_shards" not in held["nvme"]
    fits = (8 << 20) + numel * 4
    assert _grads_auto(tmp_path, fits)[0] == "cpu"
    tier, held, _ = _grads_auto(tmp_path, fits - 1)
    assert tier == "nvme" and held["nvme"]["grad_shards"] == numel * 4 and "grad_shards" not in held["cpu"]


def test_gradients_held_for_the_step_are_neither_written_nor_read(tmp_path: Path) -> None:
    """[Note: gradients held for the step]: a steady step reads and writes each sub-group's states and, of the
    gradients, only those a quarter of the pool does not hold (the sweep's first are held); the same numbers as
    the states in memory."""
    def run(offload: dict) -> tuple[list[float], zinf.ZeroInfinityEngine]:
        torch.manual_seed(0)
        config = zinf.ZeroConfig.from_dict({"offload": {"sub_group_numel": 1 << 14, **offload}})
        layers = [nn.Linear(128, 256), nn.Tanh()] + [m for _ in range(5) for m in (nn.Linear(256, 256), nn.Tanh())]
        model = nn.Sequential(*layers, nn.Linear(256, 4))
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x, y = torch.randn(8, 128, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine

    losses, engine = run({"optimizer": "nvme", "grads": "nvme", "nvme_paths": [str(tmp_path)],
                          "pinned_pool_bytes": 2 << 20})
    states, stash = engine.placement.states, engine.placement.stash
    x, y = torch.randn(8, 128), torch.randint(0, 4, (8,))
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    held = [sg for sg in states.subgroups if stash.holds(sg)]
    assert 0 < len(held) < len(states.subgroups)
    assert held == states.subgroups[: len(held)]  # the sweep's first
    engine.report()
    engine.step()
    engine.synchronize()
    counts = engine.report().counts
    state_spans = sum(rec.span for sg in states.subgroups for rec in states.records[id(sg)].values())
    grad_spans = sum(stash.record(sg).span for sg in states.subgroups[len(held):])
    assert counts["nvme_read_bytes"] == counts["nvme_written_bytes"] == state_spans + grad_spans
    engine.close()
    in_memory, engine = run({"optimizer": "cpu"})
    engine.close()
    assert losses == in_memory
