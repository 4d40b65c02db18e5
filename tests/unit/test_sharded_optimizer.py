"""[Note: foreach on CPU] in zinf/optim/sharded.py: with ``foreach`` unset, the shard optimizer steps CPU shards on
torch's multi-tensor path, which gives the same bits as the one-at-a-time loop it replaces (compared on this CPU,
never against a pinned number), and leaves the user's setting as it was."""

from __future__ import annotations

import pytest
import torch

import zinf
from models import batches, build

OPTIMIZERS = {
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=3e-3, **kw),
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
}


def _train(name: str, paths: list[bool], **kw: object) -> tuple[list[float], dict[str, torch.Tensor],
                                                                  torch.optim.Optimizer]:
    torch.manual_seed(0)
    with zinf.Init():
        model = build("gpt")
    opt = OPTIMIZERS[name](model.parameters(), **kw)
    # which path each step takes: torch reads param_group["foreach"] inside step(), after its pre-hooks
    opt.register_step_pre_hook(lambda o, args, kwargs: paths.append(bool(o.param_groups[0]["foreach"])))
    engine = zinf.initialize(model, opt)
    losses = []
    for x, y in batches("gpt", 4, 8):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    return losses, state, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unset_foreach_steps_the_same_bits_and_stays_unset(name: str) -> None:
    paths: list[bool] = []
    loop_losses, loop_state, _ = _train(name, paths, foreach=False)
    assert paths and not any(paths)
    paths.clear()
    losses, state, opt = _train(name, paths)
    assert paths and all(paths)  # the multi-tensor path ran
    assert all(pg["foreach"] is None for pg in opt.param_groups)  # and the setting is the user's again
    assert losses == loop_losses
    assert all(torch.equal(state[k], loop_state[k]) for k in state)
