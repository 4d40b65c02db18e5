"""One-process behaviour of the engine: construction values, gathering, errors, the step report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zinf
from models import GPT, GPTConfig, batches, build, make_optimizer
from zinf.param.flat_group import GroupState


def test_init_gives_same_values_as_plain_construction() -> None:
    torch.manual_seed(0)
    plain = GPT(GPTConfig()).state_dict()
    torch.manual_seed(0)
    with zinf.Init():
        model = GPT(GPTConfig())
    engine = zinf.initialize(model)
    full = engine.full_state_dict()
    assert set(full) == set(plain)
    for k, v in plain.items():
        assert torch.equal(full[k], v), k


class _Refilled(nn.Module):
    """Re-initialises its children after they are built (as Hugging Face models do), with fills whose bf16 and
    fp32 draws differ in torch (``uniform_``: about one value in a thousand)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Embedding(50, 64)
        for m in (self.a, self.b):
            m.weight.data.uniform_(-1.0, 1.0)
        nn.init.uniform_(self.a.bias, -0.5, 0.5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fills_after_partitioning_draw_at_the_built_dtype(precision: str) -> None:
    """[Note: edits draw where plain PyTorch would]: a 16-bit gathered parameter is filled as the fp32 model
    would be, then rounded, whatever torch's 16-bit fills draw."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    torch.manual_seed(0)
    plain = _Refilled().state_dict()
    torch.manual_seed(0)
    with zinf.Init(zinf.ZeroConfig(precision=precision)):
        model = _Refilled()
    full = zinf.initialize(model).full_state_dict()
    for k, v in plain.items():
        assert torch.equal(full[k].to(dtype), v.to(dtype)), k


def test_released_parameters_keep_shape_and_refuse_writes() -> None:
    with zinf.Init():
        model = nn.Linear(4, 3)
    zinf.initialize(model)
    assert model.weight.shape == (3, 4) and model.weight.dim() == 2 and model.weight.numel() == 12
    assert torch.isnan(model.weight).all(), "a stray read of a released parameter must not look like real values"
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            model.weight.add_(1.0)


def test_gathered_parameters_read_and_edit() -> None:
    torch.manual_seed(0)
    with zinf.Init():
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    engine = zinf.initialize(model)
    with zinf.GatheredParameters(model[0].weight, modifier_rank=0):
        assert torch.isfinite(model[0].weight).all()
        with torch.no_grad():
            model[0].weight.fill_(0.5)
    assert engine.groups[0].state is GroupState.SHARDED
    assert torch.equal(engine.full_state_dict()["0.weight"], torch.full((3, 4), 0.5))
    with engine.gathered_parameters():
        assert torch.equal(model[0].weight, torch.full((3, 4), 0.5))


def test_optimizer_errors_name_the_fix() -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(zinf.UnsupportedModelError, match="element-wise optimizer"):
        zinf.initialize(model, torch.optim.LBFGS(model.parameters()))
    model = nn.Linear(4, 3)
    foreign = nn.Linear(2, 2)
    with pytest.raises(zinf.UnsupportedModelError, match="not part of the model"):
        zinf.initialize(model, torch.optim.SGD(list(model.parameters()) + list(foreign.parameters()), lr=0.1))
    model = nn.Linear(4, 3)
    engine = zinf.initialize(model)
    with pytest.raises(zinf.UnsupportedModelError, match="needs an optimizer"):
        engine.step()


def test_report_breaks_down_time_and_bytes() -> None:
    torch.manual_seed(0)
    with zinf.Init():
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model))
    for x, y in batches("gpt", 2, 4):
        engine.backward(engine(x, y))
        engine.step()
    report = engine.report()
    assert report is not None and report.step == 1
    for key in ("compute", "forward", "backward", "optimizer"):
        assert report.seconds[key] > 0, key
    cpu = report.bytes["cpu"]
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    assert cpu["param_shards"] == numel * 4  # one rank: the whole model, fp32, no padding
    assert cpu["grad_shards"] == numel * 4 and cpu["optimizer_state"] == 2 * numel * 4
    assert "compute" in report.summary() and "cpu" in report.summary()


def test_lr_scheduler_on_the_users_optimizer_still_drives_the_shards() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr 0: nothing may change
    engine = zinf.initialize(model, opt)
    before = engine.full_state_dict()
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    sched.step()
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _fp16_delta(growth_interval: int) -> torch.Tensor:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"precision": "fp16", "loss_scale": {"initial_scale": 1024.0,
                                                                             "growth_interval": growth_interval}})
    model = nn.Linear(8, 4)
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    before = engine.full_state_dict()["weight"]
    engine.backward(engine(torch.ones(2, 8)).float().square().mean())
    assert engine.step()
    return engine.full_state_dict()["weight"] - before


def test_fp16_step_that_grows_the_scale_unscales_with_the_old_one() -> None:
    # regression: the scale grew before the gradients were unscaled, halving that step's update
    torch.testing.assert_close(_fp16_delta(growth_interval=1), _fp16_delta(growth_interval=1000), rtol=0, atol=0)


def test_backward_that_raises_leaves_the_engine_usable() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 6)
    out = engine(x)

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    out.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine.backward(out.sum())
    assert not engine.hooks.pass_state.in_backward and all(not g.backward_held for g in engine.groups)
    engine.zero_grad()
    engine.backward(engine(x).sum())
    engine.step()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x).sum().backward()
    opt.step()
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("offload", [{}, {"params": "cpu", "optimizer": "cpu"}])
def test_cpu_and_cpu0_are_one_device(offload: dict) -> None:
    """Front ends pass "cpu:0" (Accelerate) or "cpu": the same training either way, and no host copy is taken
    for a "transfer" between them."""
    losses = {}
    for device in ("cpu", "cpu:0"):
        torch.manual_seed(0)
        config = zinf.ZeroConfig.from_dict({"offload": offload})
        model = build("gpt")
        engine = zinf.initialize(model, make_optimizer(model, "adamw"), config, device=device)
        out = []
        for x, y in batches("gpt", 3, 4):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        losses[device] = out
        engine.close()
    assert losses["cpu"] == losses["cpu:0"]


def test_resident_bytes_count_a_shared_master_once() -> None:
    """fp32 on a CPU device with parameters on "cpu" and a device-tier optimizer: the parameter shard the host
    store keeps is the master tensor itself; it is counted once."""
    torch.manual_seed(0)
    model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model, "adamw"), zinf.ZeroConfig.from_dict({"offload": {"params": "cpu"}}))
    shards = sum(g.shard_numel * 4 for g in engine.groups)
    cpu = engine.resident_bytes()["cpu"]
    assert cpu.get("param_shards", 0) + cpu.get("master", 0) == shards
    engine.close()


def test_unfreezing_after_the_engine_is_built_names_the_fix() -> None:
    """A group frozen when the engine was built keeps no master, gradient or optimizer state (see [Note: frozen
    groups] in zinf/param/flat_group.py): training it later is refused at the next training forward."""
    with zinf.Init(zinf.ZeroConfig(precision="bf16")):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters()), zinf.ZeroConfig(precision="bf16"))
    assert [g.shard_only for g in engine.groups] == [True, False] and engine.groups[0].master is None
    model[0].weight.requires_grad_(True)
    with pytest.raises(zinf.UnsupportedModelError, match=r"requires_grad of '0.weight' changed after the engine was "
                                                         r"built.*keeps no fp32 master.*before building the engine"):
        engine(torch.randn(2, 4))
    with torch.no_grad():  # evaluation does not train: allowed
        engine(torch.randn(2, 4))


def test_a_new_engine_trains_what_an_earlier_one_froze() -> None:
    """The master comes back, widened from the bf16 shard (the frozen values), and the group trains again."""
    torch.manual_seed(0)
    config = zinf.ZeroConfig(precision="bf16")
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    first = zinf.initialize(model, torch.optim.AdamW(model.parameters()), config)
    frozen = first.full_state_dict()["0.weight"]
    first.close()
    model[0].requires_grad_(True)
    second = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1), config)
    assert not second.groups[0].shard_only and second.groups[0].master is not None
    assert torch.equal(second.full_state_dict()["0.weight"], frozen)
    second.backward(second(torch.randn(2, 4)).float().square().mean())
    second.step()
    assert not torch.equal(second.full_state_dict()["0.weight"], frozen)
