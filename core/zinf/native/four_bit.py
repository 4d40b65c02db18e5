"""4-bit block codes (bitsandbytes' NF4 and FP4): wraps ``zinf._native.four_bit`` (stub: ``_native_four_bit.pyi``
beside this file), with torch twins where the extension is missing.

- :func:`encode`: bitsandbytes' ``quantize_4bit`` of a float tensor on the CPU (its codes and block absmax, bit for
  bit: the same reciprocal, multiply, clamp and midpoint search; the tests compare them with bitsandbytes').
- :func:`block_absmax`: the block absmax alone (double quantization needs the whole tensor's).
- :func:`decode`: ``code[nibble] * scale`` in fp32 into an fp32 or bf16 output, one pass over the codes.
"""

from __future__ import annotations

import functools

import torch

from .loader import _native

__all__ = ["encode", "block_absmax", "decode", "bounds"]


@functools.lru_cache(maxsize=None)
def bounds(code: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The 15 midpoints between the sorted code values and the sort order (bitsandbytes'
    ``_get_4bit_quantize_bounds``, computed by the same torch operations)."""
    values = torch.tensor(code, dtype=torch.float32)
    order = torch.argsort(values)
    return (values[order[:-1]] + values[order[1:]]) / 2, order.to(torch.uint8)


def block_absmax(values: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Each block's largest magnitude (the last, partial block's at least 1e-38), fp32."""
    values = values.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    n = values.numel()
    out = torch.empty(-(-n // blocksize), dtype=torch.float32)
    if _native is not None:
        _native.four_bit.block_absmax(values.data_ptr(), n, blocksize, out.data_ptr(), torch.get_num_threads())
        return out
    full = n - n % blocksize
    out[: full // blocksize] = values[:full].view(-1, blocksize).abs().amax(1)
    if n % blocksize:
        out[-1] = values[full:].abs().max().clamp(min=1e-38)
    return out


def encode(values: torch.Tensor, blocksize: int, code: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes packed two a byte, high nibble first; fp32 absmax per block) of ``values`` flattened."""
    values = values.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    n = values.numel()
    midpoints, order = bounds(code)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    if _native is not None:
        _native.four_bit.encode(values.data_ptr(), n, blocksize, midpoints.data_ptr(), order.data_ptr(),
                                packed.data_ptr(), absmax.data_ptr(), torch.get_num_threads())
        return packed, absmax
    absmax.copy_(block_absmax(values, blocksize))
    full = n - n % blocksize
    scaled = torch.clamp(values[:full].view(-1, blocksize) * (1.0 / absmax[: full // blocksize].clamp(min=1e-38))
                         .view(-1, 1), -1, 1).reshape(-1)
    if n % blocksize:
        scaled = torch.cat([scaled, torch.clamp(values[full:] / absmax[-1], -1, 1)])
    if n % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    q = order.long()[torch.bucketize(scaled, midpoints)].to(torch.uint8)
    packed.copy_(q[::2] << 4 | q[1::2])
    return packed, absmax


_DECODE_CHUNK = 1 << 22  # codes decoded at a time by the torch twin (bounds its temporaries)


def decode(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, blocksize: int,
           code: tuple[float, ...]) -> None:
    """``out`` (fp32 or bf16, ``2 * codes.numel()`` elements, a multiple of ``blocksize``) = the decoded values."""
    n = out.numel()
    table = torch.tensor(code, dtype=torch.float32)
    if _native is not None and out.device.type == "cpu" and out.dtype in (torch.float32, torch.bfloat16) \
            and codes.is_contiguous() and scales.is_contiguous() and out.is_contiguous():
        _native.four_bit.decode(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), n, blocksize, table.data_ptr(),
                                out.dtype == torch.bfloat16, torch.get_num_threads())
        return
    pairs = torch.stack([table[torch.arange(256) >> 4], table[torch.arange(256) & 15]], dim=1).to(codes.device)
    step = max(_DECODE_CHUNK // blocksize * blocksize, blocksize) // 2
    for c in range(0, n // 2, step):
        m = min(step, n // 2 - c)  # bytes of codes: 2m elements
        vals = pairs[codes[c : c + m].long()].view(-1, blocksize)
        block = scales[2 * c // blocksize : 2 * (c + m) // blocksize].view(-1, 1)
        target = out[2 * c : 2 * (c + m)].view(-1, blocksize)
        if target.dtype == torch.float32:
            torch.mul(vals, block, out=target)
        else:
            target.copy_(vals * block)
