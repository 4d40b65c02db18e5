"""Widening a 16-bit shard (bf16, fp16) into fp32: wraps ``zinf._native.convert`` (stub: ``_native_convert.pyi``
beside this file).

[Note: streaming the widening]
A group stored in 16 bits and computed in fp32 (``param_storage``) is widened on every gather: on a CPU LoRA step
of a 1.1B Llama this copy took 18% of the step, at the speed of writing memory. torch's copy writes the fp32
buffer with ordinary stores, so the core first reads each destination line into its cache, a third of the copy's
traffic. The native loop writes outputs of 1 MiB (``kStreamBytes`` in cpp/convert/widen.h) and more with non-temporal stores that skip
that read: twice the speed on one core of a 2-vCPU Xeon (200 MB of fp32 out, 14.6 against 30.6 ms). The compute
reads the full buffer back from memory either way (a block's weights are larger than the cache). Smaller outputs,
which the compute may still find in the cache, keep ordinary stores. Like torch's copy it splits a large output
over the intra-op threads (each given at least 1 MiB). The values are torch's, bit for bit; an fp16 NaN comes out a
quiet NaN, where torch's own bits for one depend on whether it falls in its vector loop or its tail
(``tests/unit/native/test_widen.py``).
"""

from __future__ import annotations

import torch

from .checksum import crc32c
from .loader import _native

__all__ = ["copy_checked", "widen_into"]

_convert = getattr(_native, "convert", None)
_KINDS = {} if _convert is None else {torch.bfloat16: _convert.Narrow.BF16, torch.float16: _convert.Narrow.FP16}


def widen_into(out: torch.Tensor, src: torch.Tensor) -> None:
    """``out.copy_(src)`` for ``src`` bf16 or fp16 and ``out`` fp32 of as many elements, both contiguous in host
    memory and apart: natively (GIL released, on up to torch's intra-op thread count), see [Note: streaming the
    widening]; anything else (other dtypes or devices, strided or overlapping views, no native build) by torch's
    copy, which also refuses what it refuses."""
    kind = _KINDS.get(src.dtype)
    if kind is None or out.dtype != torch.float32 or not _native_takes(out, src):
        out.copy_(src)
        return
    _convert.widen(src.data_ptr(), out.data_ptr(), src.numel(), kind, torch.get_num_threads())
    torch.autograd.graph.increment_version(out)  # as copy_ would: autograd sees the write


def copy_checked(out: torch.Tensor, src: torch.Tensor, crc: int = 0) -> int:
    """``out.copy_(src)`` (widened where ``out`` is fp32 and ``src`` 16-bit, else of one dtype) and the CRC32C of
    ``src``'s bytes continuing from ``crc``, taken in the same pass over ``src`` (see [Note: one pass per byte] in
    zinf/offload/in_place.py). Where the native loop does not apply (as :func:`widen_into` says), torch's copy and
    a checksum of its own."""
    kind = _KINDS.get(src.dtype) if out.dtype == torch.float32 else None
    if (kind is None and out.dtype != src.dtype) or not _native_takes(out, src):
        out.copy_(src)
        return crc32c(src.reshape(-1).view(torch.uint8), crc, threads=torch.get_num_threads())
    threads = torch.get_num_threads()
    if kind is not None:
        crc = _convert.widen_crc(src.data_ptr(), out.data_ptr(), src.numel(), kind, threads, crc)
    else:
        crc = _convert.copy_crc(src.data_ptr(), out.data_ptr(), src.numel() * src.element_size(), threads, crc)
    torch.autograd.graph.increment_version(out)
    return crc


def _native_takes(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the native loops can copy ``src`` into ``out`` (whatever the dtypes): the extension is built, and
    both are contiguous host tensors of as many elements that do not overlap."""
    return (_convert is not None and out.device.type == "cpu" and src.device.type == "cpu"
            and out.numel() == src.numel() and out.is_contiguous() and src.is_contiguous() and not _overlap(out, src))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
