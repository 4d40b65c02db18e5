"""A model prepared alone and called before its optimizer is prepared (what transformers' ``Trainer.evaluate()``
before ``train()`` does): its engine is built for inference at the first call, then built again with the optimizer
when that is prepared, and it trains like PyTorch from the values it had. One process, in this one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate_zinf import Accelerator  # noqa: E402
from test_accelerate_single import _batches, _gpt  # noqa: E402
from zinf.errors import UnsupportedModelError  # noqa: E402


def _train_after_a_call(accelerator: Accelerator) -> None:
    """Evaluate, then prepare the optimizer and train 3 steps; each loss, and the evaluation, as PyTorch's."""
    ref = _gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = accelerator.prepare(_gpt())
    x, y = _batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(x, y), ref(x, y), rtol=1e-5, atol=0)
    inference_engine = model.engine
    assert inference_engine.optimizer is None
    opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert model.engine is not inference_engine and inference_engine.closed and model.engine.optimizer is not None
    for x, y in _batches(3):
        loss = model(x, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        want = ref(x, y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
    state = accelerator.get_state_dict(model)
    for name, p in ref.state_dict().items():  # relative norm: the key bias's gradient is ~0 (Adam scales noise)
        assert float((state[name] - p).norm() / p.norm().clamp_min(1e-12)) < 1e-3, name


def test_a_model_called_before_its_optimizer_is_prepared_trains_like_pytorch(fresh_state) -> None:
    _train_after_a_call(Accelerator(cpu=True))


def test_a_model_called_before_its_offloaded_optimizer_is_prepared_trains_like_pytorch(fresh_state) -> None:
    """Without an optimizer there is nothing for ``offload.optimizer`` to hold: the inference engine keeps it on the
    device, and the engine built with the optimizer offloads it."""
    _train_after_a_call(Accelerator(cpu=True, zinf_config={"offload": {"optimizer": "cpu"}}))


def test_offloaded_parameters_of_a_model_called_before_its_optimizer_is_refused_with_the_fix(fresh_state) -> None:
    accelerator = Accelerator(cpu=True, zinf_config={"offload": {"params": "cpu", "optimizer": "cpu"}})
    model = accelerator.prepare(_gpt())
    x, y = _batches(1)[0]
    with torch.no_grad():
        model(x, y)
    with pytest.raises(UnsupportedModelError, match=r"offload\.params='cpu'.*accelerator\.prepare\(model, optimizer\)"):
        accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
