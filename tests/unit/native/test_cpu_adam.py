"""CPUAdam as a drop-in optimizer: same training trajectory as torch.optim.AdamW / Adam."""

from __future__ import annotations

import pytest
import torch

from zinf.optim import CPUAdam


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_matches_torch_on_a_model(adamw_mode: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))
    ref.load_state_dict(model.state_dict())
    opt = CPUAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)
    x, y = torch.randn(64, 13), torch.randn(64, 3)
    for _ in range(10):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_cpu_adam_rejects_non_fp32() -> None:
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        CPUAdam([p]).step()
