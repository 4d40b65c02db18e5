"""The squared gradient norm and finiteness (native, with its pure-PyTorch twin), and the memory-bandwidth bound of
an Adam step (benchmarks)."""

from __future__ import annotations

import math

import torch

from .adam import _DTYPE_NAMES, _check
from .loader import _native, require

__all__ = ["grad_norm_sq", "grad_norm_sq_torch", "stream_bound"]


def grad_norm_sq_torch(grad: torch.Tensor) -> tuple[float, bool]:
    """Pure-PyTorch :func:`grad_norm_sq` (accumulates in float64)."""
    _check("grad", grad, tuple(_DTYPE_NAMES), None, "grad_norm_sq")
    total = float(torch.sum(grad.to(torch.float64).square()))
    return total, math.isfinite(total)


def grad_norm_sq(grad: torch.Tensor) -> tuple[float, bool]:
    """Sum of squares of a fp32/bf16/fp16 gradient and whether every element is finite.

    Squares are accumulated in float64 (per SIMD lane and per thread, then summed in a fixed
    order); a float64 sum of float32 squares cannot overflow, so the sum is finite exactly when
    every element is.
    """
    if _native is None:
        return grad_norm_sq_torch(grad)
    _check("grad", grad, tuple(_DTYPE_NAMES), None, "grad_norm_sq")
    total = _native.adam.grad_norm_sq(grad.data_ptr(), _DTYPE_NAMES[grad.dtype], grad.numel())
    return total, math.isfinite(total)


def stream_bound(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Benchmark helper: move Adam's 28 bytes/param (read p, g, m, v; write p, m, v), trivial math."""
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, (torch.float32,), n, "stream_bound")
    require().adam.stream_bound(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n)
