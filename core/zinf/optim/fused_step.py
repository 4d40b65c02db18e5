"""One sub-group's step of the offloaded CPU-Adam: one fused pass of the C++ kernel per stepped segment.

[Note: fused step]
One pass per sub-group: the C++ kernel reads the gradient, master and moments once, applies the gradient's
pending factors (fp16 unscale, clip coefficient: ``GradShard.take_factor``, one float32 multiply equal to
applying them one by one), steps Adam/AdamW, writes the master, the moments and the compute-dtype
parameter shard straight into the parameter store's write buffer (``param_out``), and zeroes the resident
gradient it has just read (``zero_grad``: the cache line is already there), ready for the next backward. The norms and finiteness
that clipping and loss scaling need were taken when each gradient shard was complete (zinf/param/grad_shard.py),
so the step reads each byte once: 16 bytes per parameter in (gradient, master, two moments) and 12 + 2 out
(master, moments, bf16 shard), the floor of 30, with the gradient's zeroing folded into the same pass;
torch's clip_grad_norm_, fused AdamW and copy move 46 (54 with an fp16 unscale pass). With bf16 moments
(``optimizer_storage: bf16``) the moments are 4 of them in and 4 out: 22 bytes per parameter; 18 with int8 ones
(and an exponent byte per 256 elements of each moment).
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import torch

from zinf import native
from zinf.native import AdamHyper
from zinf.native.checked_adam import adam_step_checked, can_check_in_pass
from zinf.native.checksum import crc32c_combine
from zinf.offload.record_check import RecordCheck
from zinf.offload.subgroups import STATES, SubGroup

__all__ = ["adam_sub_group", "moment_rounding"]


def moment_rounding(sg: SubGroup, offset: int, step: int) -> dict[str, int]:
    """The stochastic-rounding inputs of compact moments for elements ``sg.lo + offset`` on, of ``sg``'s group, at
    ``step`` ([Note: bf16 moments] in cpp/adam/kernel_scalar_body.h): a seed from the group's name and the step,
    and the elements' place in the group's flat vector. The same on every resume, different on every rank."""
    g = sg.group
    seed = zlib.crc32(g.name.encode()) ^ ((int(step) * 0x9E3779B1) & 0xFFFFFFFF)
    return {"seed": seed, "index_base": (g.layout.lo + sg.lo + offset) & 0xFFFFFFFF}


def adam_sub_group(sg: SubGroup, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor | None,
                   out: torch.Tensor | None, hyper: Sequence[AdamHyper], stepped: Sequence[bool],
                   steps: Sequence[int | None], factor: float, *, fp32: bool, stashed: bool,
                   scales: Callable[[int], dict[str, torch.Tensor]] = lambda j: {},
                   step_fn: Callable[..., None] = native.adam_step, check: RecordCheck | None = None) -> None:
    """Step the segments of ``sg`` whose parameters have a gradient this step (see [Note: fused step]) and copy the
    others and the gaps unchanged into ``out`` (the group's new parameter shard; None where the master is that
    shard). ``grad`` is the resident gradient, zeroed as it is read, or with ``stashed`` one read from NVMe with
    the states (left as it is); None where no gradient memory was written yet. ``scales(j)``: segment ``j``'s block
    exponents of int8 moments (``StateLayout.segment_scales``). ``step_fn``: the CPU-Adam, or its torch twin for
    states on the device ([Note: the device share] in zinf/offload/device_states.py). ``check``: the content check
    of records just read from NVMe, taken by the Adam pass itself where it can ([Note: checks in the Adam pass] in
    zinf/offload/record_check.py), else by one of its own before anything is stepped."""
    if check is not None:
        if _step_checked(sg, master, m, v, grad, out, hyper, stepped, steps, factor, stashed, check):
            return
        check.check_now()
    g = sg.group
    for j, (lo, hi, k, i) in enumerate(sg.segments):
        a, b = lo - sg.lo, hi - sg.lo
        if not stepped[i]:  # no gradient this step: unchanged, as torch leaves a parameter whose grad is None
            if out is not None:
                out[lo:hi].copy_(master[a:b])
            if grad is not None and not stashed:
                grad[a:b].zero_()
            continue
        if grad is None:  # stepped with no gradient memory yet (zeros): only when nothing wrote one
            grad = g.grad.tensor()[sg.lo : sg.hi]
        step_fn(master[a:b], grad[a:b], m[a:b], v[a:b], hyper[k], step=steps[i],
                         clip_coef=factor, param_out=None if fp32 or out is None else out[lo:hi],
                         zero_grad=not stashed, **moment_rounding(sg, a, steps[i]), **scales(j))
        if fp32 and out is not None:
            out[lo:hi].copy_(master[a:b])
    for lo, hi in sg.gaps:  # unstepped elements keep their values in the new shard
        if out is not None:
            out[lo:hi].copy_(master[lo - sg.lo : hi - sg.lo])
        if grad is not None and not stashed:
            grad[lo - sg.lo : hi - sg.lo].zero_()


def _step_checked(sg: SubGroup, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor | None,
                  out: torch.Tensor | None, hyper: Sequence[AdamHyper], stepped: Sequence[bool],
                  steps: Sequence[int | None], factor: float, stashed: bool, check: RecordCheck) -> bool:
    """``adam_sub_group`` whose passes also checksum ``sg``'s records: each stepped segment by the Adam pass, each
    range nothing steps by a CRC32C of its own, joined in address order. The parameter shard is written only once
    the records are known good. False, with nothing done, with int8 moments or a segment to step without gradient
    memory yet."""
    if not can_check_in_pass(m) or (grad is None and any(stepped[i] for _, _, _, i in sg.segments)):
        return False
    arrays = (master, m, v) + ((grad,) if stashed else ())
    names = STATES + (("grad",) if stashed else ())
    parts: list[tuple[int, int, Sequence[int], Sequence[int]]] = []  # (offset, numel, CRCs as read, as written)
    for lo, hi, k, i in sg.segments:
        a, b = lo - sg.lo, hi - sg.lo
        if stepped[i]:
            assert grad is not None
            read, written = adam_step_checked(master[a:b], grad[a:b], m[a:b], v[a:b], hyper[k], step=steps[i],
                                              clip_coef=factor, zero_grad=not stashed, grad_checksum=stashed,
                                              **moment_rounding(sg, a, steps[i]))
            parts.append((a, b - a, read[: len(arrays)], written))
        else:  # no gradient this step: unchanged, as torch leaves a parameter whose grad is None
            parts.append(_unchanged(arrays, a, b, None if stashed else grad))
    for lo, hi in sg.gaps:
        parts.append(_unchanged(arrays, lo - sg.lo, hi - sg.lo, None if stashed else grad))
    assert sum(n for _, n, _, _ in parts) == sg.hi - sg.lo, (sg.segments, sg.gaps)  # the ranges tile the records
    read_crc, written_crc = [0] * len(arrays), [0] * len(STATES)
    for a, n, read, written in sorted(parts, key=lambda p: p[0]):
        for j, x in enumerate(arrays):
            read_crc[j] = crc32c_combine(read_crc[j], read[j], n * x.element_size())
            if j < len(STATES):
                written_crc[j] = crc32c_combine(written_crc[j], written[j], n * x.element_size())
    check.check_in_pass(dict(zip(names, read_crc)), dict(zip(STATES, written_crc)))
    if out is not None:  # rounded to nearest even where it is narrower, as the kernel's param_out
        out[sg.lo : sg.hi].copy_(master)
    return True


def _unchanged(arrays: Sequence[torch.Tensor], a: int, b: int,
               resident_grad: torch.Tensor | None) -> tuple[int, int, list[int], list[int]]:
    """A range nothing steps: its CRC32C as read is the one written; a resident gradient is zeroed for the next
    backward, as the stepped ranges' are by their pass."""
    crcs = [native.crc32c(x[a:b], threads=native.require().adam.num_threads()) for x in arrays]
    if resident_grad is not None:
        resident_grad[a:b].zero_()
    return a, b - a, crcs, crcs
