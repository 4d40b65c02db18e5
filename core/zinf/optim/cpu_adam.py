"""CPUAdam: a drop-in torch.optim.Optimizer for CPU fp32 parameters, stepped by zinf's fused kernel.

Uses :func:`zinf.native.adam_step` (C++ SIMD + OpenMP when the extension is built, its pure-PyTorch
fallback otherwise). Steps match torch.optim.AdamW (``adamw_mode=True``) or torch.optim.Adam
(``adamw_mode=False``, L2 weight decay) to float rounding; see ``[Note: adam semantics]`` in
zinf/native/adam.py. Each param group's hyper-parameters are read once per step as a
:class:`zinf.native.AdamHyper`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zinf import native

logger = logging.getLogger(__name__)

__all__ = ["CPUAdam"]


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU float32 parameters with fused, multi-threaded SIMD steps."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"CPUAdam: expected lr >= 0, found {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: expected betas in [0, 1), found {betas}")
        if eps < 0.0:
            raise ValueError(f"CPUAdam: expected eps >= 0, found {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"CPUAdam: expected weight_decay >= 0, found {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = native.AdamHyper.from_param_group(group, decoupled=bool(group["adamw_mode"]))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(
                        f"CPUAdam: expected contiguous CPU float32 parameters, found dtype={p.dtype}, "
                        f"device={p.device}, contiguous={p.is_contiguous()}; keep fp32 master weights on CPU"
                    )
                if p.grad.is_sparse:
                    raise ValueError("CPUAdam: sparse gradients are not supported")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                native.adam_step(p.data, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], hyper,
                                 step=int(state["step"]))
        return loss
