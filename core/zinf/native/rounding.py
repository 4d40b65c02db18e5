"""The stochastic rounding of bf16 moments in Python: the kernel's twin (see [Note: bf16 moments] in
cpp/adam/kernel_scalar_body.h), used by ``adam_step_torch`` and the tests."""

from __future__ import annotations

import torch

__all__ = ["sr_bits", "stochastic_bf16"]


def sr_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The kernel's stochastic-rounding bits of each element index (int64 tensor of uint32 values)."""
    mask = 0xFFFFFFFF
    x = ((index * 0x9E3779B1) & mask) ^ (int(seed) & mask)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & mask
    x ^= x >> 15
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def stochastic_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bfloat16 by adding the random 16 bits ``r16`` and truncating, NaN kept (the kernel's
    rounding of bf16 moments)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = (((bits + r16) & 0xFFFFFFFF) >> 16).to(torch.int32)
    out = torch.where(x.isnan(), torch.full_like(out, 0x7FC0), out)
    return out.to(torch.int16).view(torch.bfloat16)  # wraps to the same 16 bits
