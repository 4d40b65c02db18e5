"""The stochastic rounding of bf16 moments in Python: the kernel's twin (see [Note: bf16 moments] in
cpp/adam/kernel_scalar_body.h), used by ``adam_step_torch`` and the tests."""

from __future__ import annotations

import torch

__all__ = ["element_bits", "lowbias32", "sr_bits", "stochastic_bf16"]


_MASK = 0xFFFFFFFF


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's integer hash of uint32 values held in an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def sr_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The kernel's stochastic-rounding bits of each element index (int64 tensor of uint32 values)."""
    return lowbias32(((index * 0x9E3779B1) & _MASK) ^ (int(seed) & _MASK))


def element_bits(seed: int, index_base: int, numel: int) -> torch.Tensor:
    """``sr_bits`` of elements ``index_base`` to ``index_base + numel - 1`` (indices modulo 2^32, as the kernel's)."""
    return sr_bits(seed, torch.arange(numel, dtype=torch.int64) + (int(index_base) & _MASK))


def stochastic_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bfloat16 by adding the random 16 bits ``r16`` and truncating, NaN kept (the kernel's
    rounding of bf16 moments)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = (((bits + r16) & 0xFFFFFFFF) >> 16).to(torch.int32)
    out = torch.where(x.isnan(), torch.full_like(out, 0x7FC0), out)
    return out.to(torch.int16).view(torch.bfloat16)  # wraps to the same 16 bits
