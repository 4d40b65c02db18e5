"""int8 Adam moments in Python: the kernel's codes and block scales (see [Note: int8 moments] in
cpp/adam/int8_moments.h), operation for operation, for ``adam_step_torch``, the state stores' conversions to and
from fp32 (checkpoints) and the tests.

A moment of ``n`` elements is ``n`` uint8 codes and ``blocks(n)`` int8 exponents, one per ``MOMENT_BLOCK`` elements
counted from its first element.
"""

from __future__ import annotations

import torch

from .rounding import element_bits, lowbias32

__all__ = ["MOMENT_BLOCK", "ZERO_BLOCK", "blocks", "decode", "encode", "sr_bits2"]

MOMENT_BLOCK = 256
ZERO_BLOCK = -128
LARGEST_CODE = 1.875  # both formats' largest code: reached only in blocks of the largest scale, 2^127
_BIAS = {"exp_avg": 15, "exp_avg_sq": 31}


def blocks(numel: int) -> int:
    return -(-numel // MOMENT_BLOCK)


def sr_bits2(h: torch.Tensor) -> torch.Tensor:
    """exp_avg_sq's rounding bits: a second hash of exp_avg's (``sr_bits``)."""
    return lowbias32(h ^ 0x68E31DA4)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e in fp32, exactly (e in [-127, 127])."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e.to(torch.int32))


def _scales(exps: torch.Tensor, numel: int) -> torch.Tensor:
    """Each element's 2^e (0 in a zero block)."""
    e = exps.to(torch.int32).repeat_interleave(MOMENT_BLOCK)[:numel]
    return torch.where(e == ZERO_BLOCK, torch.zeros((), dtype=torch.float32), _pow2(e.clamp(min=-127)))


def _decode_magnitude(code: torch.Tensor, bias: int) -> torch.Tensor:
    code = code.to(torch.int32)
    exp, mant = code >> 3, code & 7
    sub = mant.to(torch.float32) * 2.0 ** (-bias - 2)
    normal = ((exp - bias + 127).clamp(min=1) << 23 | (mant << 20)).view(torch.float32)
    return torch.where(exp == 0, sub, normal)


def decode(name: str, codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """The fp32 values of moment ``name`` ("exp_avg" or "exp_avg_sq") from its codes and block exponents."""
    scale = _scales(exps, codes.numel())
    if name == "exp_avg":
        c = codes.to(torch.int32)
        value = _decode_magnitude(c & 0x7F, _BIAS[name]) * scale
        return torch.where(c & 0x80 != 0, -value, value)
    return _decode_magnitude(codes, _BIAS[name]) * scale


def _block_max(t: torch.Tensor) -> torch.Tensor:
    """The largest of each block of non-negative ``t`` (the last block padded with zeros)."""
    padded = torch.zeros(blocks(t.numel()) * MOMENT_BLOCK, dtype=t.dtype)
    padded[: t.numel()] = t
    return padded.view(-1, MOMENT_BLOCK).amax(dim=1)


def _block_exponents(values: torch.Tensor) -> torch.Tensor:
    top = _block_max(values.abs())
    f, k = torch.frexp(top)
    e = torch.where(f == 0.5, k - 1, k).clamp(-127, 127)
    e = torch.where(torch.isfinite(top), e, torch.full_like(e, 127))
    return torch.where(top > 0, e, torch.full_like(e, ZERO_BLOCK)).to(torch.int8)


def _encode_magnitude(a: torch.Tensor, r20: torch.Tensor, bias: int) -> torch.Tensor:
    # NaN -> 0; past 1.875 * 2^127 (and inf) -> the largest code
    a = torch.where(a >= 0, a, torch.zeros((), dtype=torch.float32)).clamp(max=LARGEST_CODE)
    bits = a.view(torch.int32).to(torch.int64)
    u = (bits + r20) & ~0xFFFFF
    normal = ((u >> 23) - 127 + bias) << 3 | ((u >> 20) & 7)
    t = (a * 2.0 ** (bias + 2)).clamp(max=16.0)
    sub = torch.floor(t + r20.to(torch.float32) * 2.0**-20).to(torch.int64)
    return torch.where(a >= 2.0 ** (1 - bias), normal, sub)


def encode(name: str, values: torch.Tensor, seed: int, index_base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``values`` of moment ``name`` as (uint8 codes, int8 block exponents), rounded stochastically with the
    bits of element ``i`` at ``index_base + i`` and ``seed``."""
    values = values.to(torch.float32).contiguous()
    n = values.numel()
    exps = _block_exponents(values)
    scale = _scales(exps, n)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros((), dtype=torch.float32))
    h = element_bits(seed, index_base, n)
    bias = _BIAS[name]
    if name == "exp_avg":
        y = values * inv
        mag = _encode_magnitude(y.abs(), h & 0xFFFFF, bias)
        codes = torch.where(mag == 0, mag, mag | torch.where(y < 0, 0x80, 0))
    else:
        mag = _encode_magnitude(values * inv, sr_bits2(h) & 0xFFFFF, bias)
        codes = torch.where(values > 0, mag.clamp(min=1), torch.zeros_like(mag))
    codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
    return _canonical(name, codes, exps)


def _canonical(name: str, codes: torch.Tensor, exps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One encoding per value (the kernel's): a block whose codes are all 0 is a zero block, and a block whose largest
    code is 0.5 takes the scale halved and its codes doubled, exactly (``halve_scale``)."""
    n, bias = codes.numel(), _BIAS[name]
    signed = name == "exp_avg"
    mag = codes & 0x7F if signed else codes
    top = _block_max(mag)
    exps = torch.where(top == 0, torch.full_like(exps, ZERO_BLOCK), exps)
    half = (top == (14 if signed else 30) << 3) & (exps.to(torch.int64) > -127)
    if bool(half.any()):
        redo = half.repeat_interleave(MOMENT_BLOCK)[:n] & (mag != 0)
        doubled = _encode_magnitude(_decode_magnitude(mag, bias) * 2.0, torch.zeros_like(mag), bias)
        mag = torch.where(redo, doubled, mag)
        codes = mag | (codes & 0x80) if signed else mag
        exps = torch.where(half, exps.to(torch.int64) - 1, exps.to(torch.int64)).to(torch.int8)
    return codes.to(torch.uint8), exps
