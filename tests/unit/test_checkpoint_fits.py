"""A checkpoint of another model or optimizer is refused before anything loads: the engine keeps its values and
trains on. One process, real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.errors import CheckpointError


class _Scaled(nn.Module):
    def __init__(self, shape: tuple[int, ...], name: str = "scale") -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer(name, torch.full(shape, 2.0))


def test_another_models_buffers_are_refused_before_anything_loads(tmp_path: Path) -> None:
    """Buffers are checked like parameters: another shape (which ``copy_`` would broadcast) or another name is an
    error, in a sharded checkpoint and in ``load_full_state_dict``, and the model keeps its values."""
    first = _Scaled((1,))
    saved = zinf.initialize(first, torch.optim.AdamW(first.parameters()))
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    state = saved.full_state_dict()
    saved.close()
    for model, match in ((_Scaled((4,)), "buffer scale is \\[1\\] in the checkpoint, \\[4\\] in the model"),
                         (_Scaled((1,), "other"), "missing buffers \\['other'\\]; unexpected buffers \\['scale'\\]")):
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters()))
        before = {n: b.clone() for n, b in model.named_buffers()}
        with pytest.raises(CheckpointError, match=match):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
        with pytest.raises(zinf.errors.UnsupportedModelError, match="buffer|missing keys"):
            engine.load_full_state_dict(state)
        assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
        engine.close()



def test_another_optimizers_state_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """An optimizer of other parameter groups, or state the offloaded CPU-Adam does not keep (SGD's momentum), is
    refused as a checkpoint error naming the fix, not a partly loaded engine."""
    torch.manual_seed(0)
    first = _Scaled((1,))
    sgd = torch.optim.SGD([{"params": [first.lin.weight]}, {"params": [first.lin.bias]}], lr=0.1, momentum=0.9)
    saved = zinf.initialize(first, sgd)
    saved.backward(saved.module.lin(torch.randn(2, 8)).square().mean())
    saved.step()
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    saved.close()
    for offload, match in (({}, "2 parameter groups, this optimizer 1"),
                           ({"optimizer": "cpu"}, "2 parameter groups, this optimizer 1")):
        model = _Scaled((1,))
        engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"offload": offload})
        before = [p.detach().clone() for p in engine.full_state_dict().values()]
        with pytest.raises(CheckpointError, match=f"{match}.*Nothing was loaded"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert all(torch.equal(a, b) for a, b in zip(before, engine.full_state_dict().values()))
        engine.backward(engine.module.lin(torch.randn(2, 8)).square().mean())
        engine.step()  # not left partly loaded: it trains on
        engine.close()
