"""zinf/backward_pass.py: the error a failed backward raised is the one the caller sees, even where dropping its
partial gradients raises too ([Note: cleaning up after a backward that raised]); ``step()`` then refuses until
``zero_grad()``, after which the run goes on exactly as one where the backward never ran. One process, fp32."""

from __future__ import annotations

import pytest
import torch
import zinf
from failing import Fail, ThreeLinear, armed
from zinf.errors import ZinfError


def _run(fail: bool) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    with zinf.Init():
        model = ThreeLinear()
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def dropping_fails() -> None:
        raise OSError("the swap disk is gone")

    engine.backward_pass.zero_grad = dropping_fails  # the clean-up's own step fails
    g, losses, seen = torch.Generator().manual_seed(2), [], []
    for step in range(3):
        x, other = torch.randn(2, 8, 16, generator=g)
        if fail and step == 1:
            with armed(), pytest.raises(Fail) as raised:
                engine.backward(engine(other))
            seen.extend(getattr(raised.value, "__notes__", []))
            with pytest.raises(ZinfError, match=r"unknown.*zero_grad\(\)"):
                engine.step()
            engine.zero_grad()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses, seen


def test_a_clean_up_that_raised_keeps_the_backwards_error_and_the_step_waits_for_zero_grad() -> None:
    clean, _ = _run(fail=False)
    failed, notes = _run(fail=True)
    assert len(notes) == 1 and "the swap disk is gone" in notes[0] and "zero_grad()" in notes[0], notes
    assert failed == clean  # bit for bit: zero_grad dropped every partial gradient
