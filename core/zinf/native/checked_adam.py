"""The CPU-Adam pass that also checksums what it reads and writes ([Note: checksums in the Adam pass] in
cpp/adam/adam.h): an offloaded sub-group's records are checked against their trailers and its writes stamped
without passes of their own over memory.
"""

from __future__ import annotations

import torch

from .adam import AdamHyperLike, _DTYPE_NAMES, _STATE_NAMES, _check_adam, _native_hyper
from .loader import _native

__all__ = ["adam_step_checked", "can_check_in_pass"]

Crcs = tuple[tuple[int, int, int, int], tuple[int, int, int]]


def can_check_in_pass(exp_avg: torch.Tensor) -> bool:
    """Whether the native pass can checksum moments of this dtype (float32, bfloat16; not int8 codes, whose block
    exponents live in the same record), and the extension is built."""
    return _native is not None and exp_avg.dtype in (torch.float32, torch.bfloat16)


def adam_step_checked(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      hyper: AdamHyperLike, *, step: int, clip_coef: float = 1.0, zero_grad: bool = False,
                      grad_checksum: bool = False, seed: int = 0, index_base: int = 0) -> Crcs:
    """``adam_step`` (same arguments, same results bit for bit; no ``param_out``, no int8 moments) that returns the
    CRC32C of ``param``, ``exp_avg``, ``exp_avg_sq`` and (``grad_checksum``, else 0) ``grad`` as they were read,
    and of ``param``, ``exp_avg``, ``exp_avg_sq`` as written: each equal to ``crc32c`` of the whole tensor's
    bytes."""
    if not can_check_in_pass(exp_avg):
        raise RuntimeError("adam_step_checked needs the native extension and float32 or bfloat16 moments; "
                           "call adam_step and crc32c apart")
    _check_adam(param, grad, exp_avg, exp_avg_sq, None, step, (None, None))
    if zero_grad and grad.dtype != torch.float32:
        raise ValueError(f"adam_step_checked: zero_grad needs a float32 gradient, found {grad.dtype}")
    read, written = _native.adam.adam_step_checked(
        param.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), _native_hyper(hyper), step=int(step), clip_coef=float(clip_coef), zero_grad=bool(zero_grad),
        state_dtype=_STATE_NAMES[exp_avg.dtype], seed=int(seed) & 0xFFFFFFFF, index_base=int(index_base) & 0xFFFFFFFF,
        grad_checksum=bool(grad_checksum))
    return tuple(read), tuple(written)  # type: ignore[return-value]
