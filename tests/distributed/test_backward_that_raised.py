"""A backward that raises part way (inside a checkpointed block's recomputation, or in the first layer's backward,
after the later layers' gradients were produced, bucketed and reduce-scattered) leaves nothing behind that the next
steps would train on ([Note: a backward that raised] in zinf/update/accumulation.py): with no earlier micro-batch
its partial gradients are dropped, and the run goes on exactly as if it never ran; after earlier micro-batches
``step()`` refuses until ``zero_grad()``. 1 and 2 gloo ranks, fp32, against the same engine run without the
failure."""

from __future__ import annotations

import os

import pytest
import torch

import zinf
from dist_utils import run_distributed
from failing import Fail, ThreeLinear, armed
from models import GPT, GPTConfig, batches, make_optimizer
from zinf.device_memory import STAGED_DEVICE_ENV
from zinf.errors import ZinfError
from zinf.param.state import GroupState

pytestmark = pytest.mark.distributed


def _engine() -> tuple[zinf.ZeroInfinityEngine, GPT]:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"activation_checkpointing": {"modules": ["Block"]}})
    with zinf.Init(config):
        model = GPT(GPTConfig(n_layer=3, block=32, n_embd=64))
    return zinf.initialize(model, make_optimizer(model), config), model


def _run(rank: int, world: int, plan: list[list[tuple[int, bool]]]) -> dict:
    """``plan``: per step, its micro-batches as (batch index, whether its backward raises in the recomputation of
    the middle block's first linear layer, the second time it runs)."""
    engine, model = _engine()
    layer, arm = model.blocks[1].fc, {"on": False, "calls": 0}
    forward = layer.forward

    def failing(x: torch.Tensor) -> torch.Tensor:
        arm["calls"] += 1
        if arm["on"] and arm["calls"] == 2:
            raise Fail("in the recomputation")
        return forward(x)

    layer.forward = failing
    data = batches("gpt", 4, 8)
    losses, refused, after_raise = [], [], []
    for micro in plan:
        for index, fails in micro:
            x, y = data[index]
            arm.update(on=fails, calls=0)
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            try:
                engine.backward(loss / len(micro))
            except Fail:
                after_raise.append(([g.name for g in engine.groups if g.state is not GroupState.SHARDED],
                                    engine.fetcher.gathered_bytes, len(engine.hooks.stack)))
                continue
            losses.append(loss.item())
        try:
            engine.step()
        except ZinfError as e:
            refused.append(str(e))
            engine.zero_grad()
    engine.close()
    return {"losses": losses, "refused": refused, "after_raise": after_raise}


PLANS = {
    # one micro-batch a step: the failed backward's step is a step with no gradients, then the run goes on
    "dropped": [[(0, False)], [(1, True)], [(1, False)], [(2, False)]],
    "clean": [[(0, False)], [(1, False)], [(2, False)]],
    # two micro-batches, the second's backward raising: the step refuses, zero_grad drops both, the run goes on
    "mixed": [[(0, False), (1, True)], [(0, False), (1, False)], [(2, False), (3, False)]],
    "again": [[(0, False), (1, False)], [(2, False), (3, False)]],
}


def _run_all(rank: int, world: int) -> dict[str, dict]:
    return {name: _run(rank, world, plan) for name, plan in PLANS.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_a_backward_that_raised_leaves_nothing_to_train_on(world: int) -> None:
    runs = run_distributed(_run_all, world)[0]
    assert runs["dropped"]["after_raise"] == [([], 0, 0)]  # nothing gathered, no call left open
    assert runs["dropped"]["losses"] == runs["clean"]["losses"]  # bit for bit: the same operations on the same values
    assert len(runs["mixed"]["refused"]) == 1 and "zero_grad()" in runs["mixed"]["refused"][0]
    assert runs["mixed"]["losses"][1:] == runs["again"]["losses"]


def _late_raise(rank: int, world: int, staged: bool) -> dict[str, list[float]]:
    """The same steps with and without a backward raising in the first layer (on another batch, at the first step and
    after two), parameters on the compute device; ``staged``: the CPU standing in for a device apart, gradients
    landing in host memory for the CPU-Adam."""
    if staged:
        os.environ[STAGED_DEVICE_ENV] = "1"  # this rank's process only
    config = {"offload": {"optimizer": "cpu"}} if staged else {}
    out = {}
    for fail in (False, True):
        torch.manual_seed(0)
        with zinf.Init(config):
            model = ThreeLinear()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if staged else torch.optim.SGD(model.parameters(), lr=0.1)
        engine = zinf.initialize(model, opt, config)
        g, losses = torch.Generator().manual_seed(2), []
        for step in range(4):
            x, other = (t.chunk(world)[rank] for t in torch.randn(2, 8, 16, generator=g))
            if fail and step in (0, 2):
                with armed(), pytest.raises(Fail):
                    engine.backward(engine(other))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.close()
        out["failed" if fail else "clean"] = losses
    return out


@pytest.mark.parametrize("world, staged", [(2, False), (1, True)])
def test_reductions_of_a_backward_that_raised_are_dropped(world: int, staged: bool) -> None:
    """Gradients bucketed or reduce-scattered in flight when the backward raised reach no shard."""
    for rank in run_distributed(_late_raise, world, staged):
        assert rank["failed"] == rank["clean"]
