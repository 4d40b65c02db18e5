"""fp32 zinf matches one plain PyTorch process on the model patterns real training brings (tests/patterns.py):
checkpointed blocks (non-reentrant with early stop, reentrant, nested, transformers'
``gradient_checkpointing_enable()``), frozen parameters handed to the optimizer, modules skipped on every
rank in some steps and on one rank only, dataclass / named-tuple / nested outputs, and mixture-of-experts
layers whose routing differs per rank (hand-written and transformers' SwitchTransformers), found by zinf
itself or named as units. Per-step losses within 1e-5 relative, frozen weights bit-unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import make_optimizer
from patterns import PATTERNS, Pattern, build, zinf_settings

pytestmark = pytest.mark.distributed


def _reference(pattern: Pattern) -> tuple[list[float], dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build(pattern)
        opt = make_optimizer(model)
        losses = []
        for x, y in pattern.data(pattern.steps, pattern.batch):
            loss = pattern.loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _train(rank: int, world: int, pattern: Pattern, nvme_dir: str) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict(zinf_settings(pattern, nvme_dir))
    for path in config.offload.nvme_paths:
        os.makedirs(path, exist_ok=True)
    with zinf.Init(config):
        model = build(pattern)
    engine = zinf.initialize(model, make_optimizer(model), config)
    losses = []
    for x, y in pattern.data(pattern.steps, pattern.batch):
        loss = pattern.loss(engine, x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    out = {"losses": losses, "state": engine.full_state_dict(), "units": engine.hooks.units,
           "divergent_rounds": engine.rounds.num_divergent_rounds, "stack": len(engine.hooks.stack),
           "gathered": [g.name for g in engine.groups if g.state.name != "SHARDED" and not g.persistent],
           "frozen_grad_shards": [g.name for g in engine.groups if not g.trainable and g.grad.resident is not None]}
    engine.close()
    return out


def _train_all(rank: int, world: int, names: list[str], nvme_dir: str) -> dict[str, dict]:
    return {name: _train(rank, world, PATTERNS[name], nvme_dir) for name in names}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    return {name: _reference(p) for name, p in PATTERNS.items()}


def _check(name: str, world: int, got: dict, ref: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_state = ref
    pattern = PATTERNS[name]
    r, z = torch.tensor(ref_losses, dtype=torch.float64), torch.tensor(got["losses"], dtype=torch.float64)
    rel = ((z - r).abs() / r.abs()).max().item()
    assert rel < 1e-5, f"{name} on {world} rank(s): losses {got['losses']} vs PyTorch {ref_losses} (max rel {rel:.2e})"
    for k, v in ref_state.items():
        if k.startswith(pattern.freeze) and pattern.freeze:
            assert torch.equal(got["state"][k], v), f"{name} on {world} rank(s): frozen weight {k} changed"
        else:
            drift = ((got["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item()
            assert drift < 1e-3, f"{name} on {world} rank(s): weight {k} drifted {drift:.2e} (relative norm)"
    assert got["stack"] == 0, f"{name}: {got['stack']} forward calls left on the hook stack"
    assert not got["gathered"], f"{name}: groups left gathered after training: {got['gathered']}"
    assert not got["frozen_grad_shards"], f"{name}: frozen groups hold gradient shards: {got['frozen_grad_shards']}"


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_patterns_match_pytorch(world: int, references, tmp_path) -> None:
    names = list(PATTERNS) if world < 4 else [n for n in PATTERNS if not n.startswith("hf_")]
    results = run_distributed(_train_all, world, names, str(tmp_path))[0]
    for name in names:
        _check(name, world, results[name], references[name])
    if world > 1:
        # the routing really differed between ranks, and zinf grouped the MoE layers itself
        assert results["moe_auto"]["units"] and all(u.endswith(".moe") for u in results["moe_auto"]["units"]), results["moe_auto"]["units"]
        assert results["moe_unit"]["divergent_rounds"] == 0 and len(results["moe_unit"]["units"]) == 2
        if "hf_switch_transformers_moe" in results:
            units = results["hf_switch_transformers_moe"]["units"]
            assert units and all(u.endswith("mlp.experts") for u in units), units
            named = results["hf_switch_transformers_moe_unit"]
            assert named["divergent_rounds"] == 0 and len(named["units"]) == len(units), named["units"]
            blocks = results["hf_switch_transformers_moe_blocks"]  # its _no_split_modules: SwitchTransformersBlock
            assert blocks["divergent_rounds"] == 0 and blocks["units"], blocks["units"]
        # unit_policy="blocks" (the default): each block, its MoE layer inside, is one unit from the first step
        assert results["moe_blocks"]["divergent_rounds"] == 0, results["moe_blocks"]
        assert results["moe_blocks"]["units"] == ["blocks.0", "blocks.1"], results["moe_blocks"]["units"]
        assert results["moe_one_block"]["units"] == ["blocks.0.moe"], results["moe_one_block"]["units"]


def _diverge_strictly(rank: int, world: int) -> str:
    pattern = PATTERNS["moe_auto"]
    torch.manual_seed(0)
    config = zinf.ZeroConfig(divergence="error", unit_policy="modules")
    with zinf.Init(config):
        model = build(pattern)
    engine = zinf.initialize(model, make_optimizer(model), config)
    x, y = pattern.data(1, pattern.batch)[0]
    try:
        loss = pattern.loss(engine, x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    except zinf.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_divergence_error_names_the_modules_and_the_fix() -> None:
    messages = run_distributed(_diverge_strictly, 2)
    for msg in messages:
        assert "ranks disagree on which parameters to gather" in msg, msg
        assert "experts" in msg and "unit_modules" in msg and "divergence='auto'" in msg, msg
