"""Fused CPU Adam/AdamW: wraps ``zinf._native.adam`` (stub: ``_native_adam.pyi`` beside this file).

- :class:`AdamHyper`: one param group's hyper-parameters, the type both Python and the binding take
  (the C++ struct ``zinf::adam::AdamHyper`` when the extension is built, else :class:`PythonAdamHyper`).
- :func:`adam_step` (native) / :func:`adam_step_torch` (pure PyTorch, the fallback and test oracle).
- :func:`grad_factor`: the exact float32 gradient multiplier :func:`adam_step` applies.
- squared gradient norms and the streaming bound: zinf/native/grad_norm.py.

[Note: adam semantics] One step matches the single-tensor path of ``torch.optim.Adam`` /
``torch.optim.AdamW`` (amsgrad=False, maximize=False) on ``grad * (clip_coef / grad_scale)``,
where the factor is computed in double and applied as a float32 multiply. Adam's weight decay is
L2 (``grad += wd * param``); AdamW's is decoupled (``param *= 1 - lr * wd``). With bfloat16 moments the
same fp32 math runs on the widened moments, which are stored back rounded stochastically with hashed bits
(see [Note: bf16 moments] in cpp/adam/kernel_scalar_body.h; zinf/native/rounding.py is its twin).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch

from zinf.device_memory import is_device_memory

from .loader import _native
from . import moment_codes
from .rounding import element_bits, stochastic_bf16

__all__ = [
    "AdamHyper",
    "AdamHyperLike",
    "PythonAdamHyper",
    "adam_step",
    "adam_step_torch",
    "grad_factor",
    "MOMENT_DTYPES",
]

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # uint8: int8 codes with block exponents

# --------------------------------------------------------------------------- hyper-parameters

_HYPER_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled")


class AdamHyperLike(Protocol):
    """Anything with AdamHyper's six read-only fields (AdamHyper, PythonAdamHyper, a frozen dataclass...)."""

    @property
    def lr(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def decoupled(self) -> bool: ...


_H = TypeVar("_H")


def _from_param_group(cls: type[_H], pg: Mapping[str, Any], decoupled: bool = False) -> _H:
    beta1, beta2 = pg["betas"]
    decoupled = bool(decoupled) or bool(pg.get("decoupled_weight_decay", False))
    return cls(float(pg["lr"]), float(beta1), float(beta2), float(pg["eps"]),  # type: ignore[call-arg]
               float(pg["weight_decay"]), decoupled)


@dataclass(frozen=True)
class PythonAdamHyper:
    """One param group's Adam/AdamW hyper-parameters, in pure Python.

    The same fields, order, defaults (torch.optim.Adam's) and conversions (floats, a bool) as the
    native ``zinf._native.adam.AdamHyper``; :class:`AdamHyper` is this class when the extension is
    missing. ``decoupled=True`` is AdamW (``param *= 1 - lr * weight_decay``), False is Adam with L2
    decay (``grad += weight_decay * param``).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        for name in _HYPER_FIELDS[:-1]:
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "decoupled", bool(self.decoupled))

    @classmethod
    def from_param_group(cls, pg: Mapping[str, Any], decoupled: bool = False) -> PythonAdamHyper:
        """The hyper-parameters of a torch optimizer param group (``lr``, ``betas``, ``eps``, ``weight_decay``).

        Each is read as a Python float (a tensor ``lr`` included). The result is decoupled (AdamW) when
        ``decoupled`` is True (pass ``isinstance(optimizer, torch.optim.AdamW)``) or the group has a true
        ``decoupled_weight_decay`` (``torch.optim.Adam(..., decoupled_weight_decay=True)``).
        """
        return _from_param_group(cls, pg, decoupled)


if TYPE_CHECKING:
    AdamHyper = PythonAdamHyper
elif _native is not None:

    class AdamHyper(_native.adam.AdamHyper):
        """One param group's Adam/AdamW hyper-parameters: the C++ ``zinf::adam::AdamHyper`` (read-only fields).

        ``AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False)``;
        the same constructor and fields as :class:`PythonAdamHyper`, which replaces it when the
        extension is missing. :func:`adam_step` passes it to the kernel without conversion.
        """

        @classmethod
        def from_param_group(cls, pg: Mapping[str, Any], decoupled: bool = False) -> AdamHyper:
            """The hyper-parameters of a torch optimizer param group; see :meth:`PythonAdamHyper.from_param_group`."""
            return _from_param_group(cls, pg, decoupled)

        def __repr__(self) -> str:
            return f"AdamHyper({', '.join(f'{k}={getattr(self, k)!r}' for k in _HYPER_FIELDS)})"

        def __hash__(self) -> int:
            return hash(tuple(getattr(self, k) for k in _HYPER_FIELDS))

        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # pickle / copy.deepcopy
            return type(self), tuple(getattr(self, k) for k in _HYPER_FIELDS)

else:
    AdamHyper = PythonAdamHyper


def _hyper_of(
    fn: str, hyper: AdamHyperLike | None, lr: float | None, beta1: float | None, beta2: float | None,
    eps: float | None, weight_decay: float | None, decoupled: bool | None,
) -> AdamHyperLike:
    loose = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
             "decoupled": decoupled}
    if hyper is not None:
        given = [k for k, v in loose.items() if v is not None]
        if given:
            raise TypeError(f"{fn}: pass the hyper-parameters either as `hyper` or as keywords, not both "
                            f"(got `hyper` and {', '.join(given)})")
        return hyper
    missing = [k for k, v in loose.items() if v is None]
    if missing:
        raise TypeError(f"{fn}: missing hyper-parameters {', '.join(missing)}; pass "
                        f"`hyper=AdamHyper(lr=..., beta1=..., beta2=..., eps=..., weight_decay=..., decoupled=...)`")
    return AdamHyper(lr, beta1, beta2, eps, weight_decay, decoupled)  # type: ignore[arg-type]


def _native_hyper(h: AdamHyperLike) -> Any:
    assert _native is not None
    if isinstance(h, _native.adam.AdamHyper):
        return h
    return _native.adam.AdamHyper(float(h.lr), float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay),
                                  bool(h.decoupled))


# --------------------------------------------------------------------------- validation

_STATE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "int8"}

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int | None, fn: str,
           device: torch.device | None = None, staged: bool | None = None) -> None:
    """``device``: the one device every tensor of the call must be on (the torch twin); None: host memory (native).
    ``staged``: with the CPU standing in for a device, whether every tensor must be marked device memory (as the
    ``param`` is), so host tensors never mix with the stand-in device's."""
    on_device = (t.device.type == "cpu" and not is_device_memory(t)) if device is None else t.device == device
    if staged is not None and isinstance(t, torch.Tensor) and is_device_memory(t) != staged:
        raise ValueError(f"{fn}: `{name}` is {'host' if staged else 'device'} memory where `param` is "
                         f"{'device' if staged else 'host'} memory (ZINF_STAGED_DEVICE=1 stands the CPU in for a "
                         f"device); pass every tensor of the call from the same memory")
    ok = (
        isinstance(t, torch.Tensor)
        and on_device
        and t.dtype in dtypes
        and t.is_contiguous()
        and (numel is None or t.numel() == numel)
    )
    if ok:
        return
    want = "/".join(str(d).removeprefix("torch.") for d in dtypes) + ("" if device is None else f" ({device})")
    if not isinstance(t, torch.Tensor):
        found = f"type {type(t).__name__}"
    else:
        found = (
            f"dtype={str(t.dtype).removeprefix('torch.')}, device={t.device}, "
            f"contiguous={t.is_contiguous()}, numel={t.numel()}"
        )
    size = f" with {numel} elements" if numel is not None else ""
    if device is None and isinstance(t, torch.Tensor) and t.device.type == "cpu" and is_device_memory(t):
        found += " (device memory: ZINF_STAGED_DEVICE=1 stands the CPU in for a GPU)"
    raise ValueError(
        f"{fn}: expected `{name}` to be a contiguous {'CPU ' if device is None else ''}{want} tensor{size}, "
        f"found {found}; "
        f"pass e.g. `{name}.detach().contiguous()` of the right dtype and size"
    )


def _check_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    step: int,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    device: torch.device | None = None,
) -> None:
    staged = is_device_memory(param) if device is not None and device.type == "cpu" else None
    _check("param", param, (torch.float32,), None, "adam_step", device)
    n = param.numel()
    _check("grad", grad, (torch.float32, torch.bfloat16, torch.float16), n, "adam_step", device, staged)
    _check("exp_avg", exp_avg, MOMENT_DTYPES, n, "adam_step", device, staged)
    _check("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), n, "adam_step", device, staged)
    if exp_avg.dtype == torch.uint8:
        for name, t in (("exp_avg_scale", scales[0]), ("exp_avg_sq_scale", scales[1])):
            if t is None:
                raise ValueError(f"adam_step: int8 moments (uint8 codes) need `{name}`: an int8 tensor of "
                                 f"{moment_codes.blocks(n)} block exponents")
            _check(name, t, (torch.int8,), moment_codes.blocks(n), "adam_step", device, staged)
    if param_out is not None:
        _check("param_out", param_out, (torch.bfloat16, torch.float16), n, "adam_step", device, staged)
    if int(step) < 1:
        raise ValueError(f"adam_step: expected step >= 1 (the step count after this update), found {step}")


# --------------------------------------------------------------------------- Adam


def grad_factor(grad_scale: float = 1.0, clip_coef: float = 1.0) -> float:
    """The float32 number :func:`adam_step` multiplies every gradient element by (returned as a Python float).

    ``float32(clip_coef / grad_scale)``: the quotient is computed in double (Python floats) and rounded
    once, to nearest, to float32. It overflows to inf like the kernel's cast does.
    """
    with np.errstate(over="ignore"):
        return float(np.float32(float(clip_coef) / float(grad_scale)))


def adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyperLike | None = None,
    *,
    step: int,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    param_out: torch.Tensor | None = None,
    zero_grad: bool = False,
    seed: int = 0,
    index_base: int = 0,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    decoupled: bool | None = None,
) -> None:
    """Pure-PyTorch Adam/AdamW step with the signature and semantics of :func:`adam_step` (see module note), on
    tensors of any one device (the offloaded optimizer's device share steps with it: [Note: the device share] in
    zinf/offload/device_states.py)."""
    _check_adam(param, grad, exp_avg, exp_avg_sq, param_out, step, (exp_avg_scale, exp_avg_sq_scale), param.device)
    h = _hyper_of("adam_step_torch", hyper, lr, beta1, beta2, eps, weight_decay, decoupled)
    lr_, beta1_, beta2_, eps_, wd = float(h.lr), float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay)
    with torch.no_grad():
        # a Python-float scalar is rounded to the tensor's float32: one multiply by grad_factor(...)
        g = grad.to(torch.float32).mul(float(clip_coef) / float(grad_scale))
        if bool(h.decoupled):
            param.mul_(1.0 - lr_ * wd)
        elif wd != 0.0:
            g = g.add(param, alpha=wd)
        if exp_avg.dtype == torch.uint8:  # int8 codes: decoded exactly
            assert exp_avg_scale is not None and exp_avg_sq_scale is not None
            m = moment_codes.decode("exp_avg", exp_avg, exp_avg_scale)
            v = moment_codes.decode("exp_avg_sq", exp_avg_sq, exp_avg_sq_scale)
        else:
            m, v = exp_avg.float(), exp_avg_sq.float()  # exact widening of bf16 moments; fp32 ones in place
        m.lerp_(g, 1.0 - beta1_)
        v.mul_(beta2_).addcmul_(g, g, value=1.0 - beta2_)
        bias_correction1 = 1.0 - beta1_**step
        bias_correction2 = 1.0 - beta2_**step
        denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps_)
        param.addcdiv_(m, denom, value=-(lr_ / bias_correction1))
        if exp_avg.dtype == torch.bfloat16:
            r = element_bits(seed, index_base, exp_avg.numel())
            exp_avg.copy_(stochastic_bf16(m, r & 0xFFFF))
            exp_avg_sq.copy_(stochastic_bf16(v, r >> 16))
        elif exp_avg.dtype == torch.uint8:
            assert exp_avg_scale is not None and exp_avg_sq_scale is not None
            for codes, exps, name, value in ((exp_avg, exp_avg_scale, "exp_avg", m),
                                             (exp_avg_sq, exp_avg_sq_scale, "exp_avg_sq", v)):
                new_codes, new_exps = moment_codes.encode(name, value, seed, index_base)
                codes.copy_(new_codes)
                exps.copy_(new_exps)
        if param_out is not None:
            param_out.copy_(param)
        if zero_grad:
            grad.zero_()


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyperLike | None = None,
    *,
    step: int,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    param_out: torch.Tensor | None = None,
    zero_grad: bool = False,
    seed: int = 0,
    index_base: int = 0,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    decoupled: bool | None = None,
) -> None:
    """One fused Adam (``hyper.decoupled`` False) or AdamW (True) step, in place, in one pass over memory.

    This is the function the fused optimizer step uses: unscaling, clipping, the Adam update and
    the compute-dtype copy of the parameter all happen in the same pass.

    - ``param``: contiguous CPU float32; ``exp_avg``, ``exp_avg_sq``: contiguous CPU float32, or both bfloat16
      (compact moments: widened exactly, stepped in fp32, stored rounded stochastically with the bits
      ``sr_bits(seed, index_base + i)`` of element ``i``), or both uint8 codes with int8 block exponents
      ``exp_avg_scale`` / ``exp_avg_sq_scale`` ([Note: int8 moments] in cpp/adam/int8_moments.h); all updated
      in place.
    - ``grad``: contiguous CPU float32/bfloat16/float16 of the same numel; modified only with ``zero_grad``.
    - ``hyper``: an :class:`AdamHyper` (e.g. ``AdamHyper.from_param_group(pg, decoupled=...)``);
      any object with its six fields is accepted (converted to the native struct per call).
      The legacy keyword form ``lr=, beta1=, beta2=, eps=, weight_decay=, decoupled=`` (all six,
      instead of ``hyper``) is still accepted.
    - ``step``: the step count including this update (1 on the first call); sets bias correction.
    - ``grad_scale``, ``clip_coef``: gradient factor. Each gradient element is converted to float32
      (exact for bf16/fp16) and multiplied once, in float32, by ``f = float32(clip_coef / grad_scale)``:
      the quotient is computed in double (Python floats / C++ doubles) and rounded once to float32
      (:func:`grad_factor` returns ``f``). The default 1.0/1.0 gives ``f = 1`` (the gradient as is).
      This equals ``grad.float().mul(clip_coef / grad_scale)`` bit for bit, but not, in general,
      successive float32 multiplies such as ``g.mul_(1 / grad_scale).mul_(clip_coef)``, which round twice.
      To fold several pending multipliers ``f1 .. fk`` into one step, pass
      ``clip_coef=f1 * ... * fk`` (a product of Python floats) with ``grad_scale=1.0``, or the clip
      factor as ``clip_coef`` and the loss scale as ``grad_scale``.
    - ``param_out``: optional contiguous bf16/fp16 tensor of the same numel; receives the updated
      float32 parameter rounded to nearest even (exactly ``param.to(param_out.dtype)``).
    - ``zero_grad``: the same pass also zeroes ``grad`` (float32 only) once it has read each element,
      so the gradient is ready for the next backward without a pass of its own.

    Weight decay is applied after the gradient factor: AdamW multiplies ``param`` by
    ``float32(1 - lr * weight_decay)``, Adam adds ``weight_decay * param`` to the scaled gradient.
    See ``[Note: adam semantics]`` in this module. Without the extension, :func:`adam_step_torch` runs.
    """
    h = _hyper_of("adam_step", hyper, lr, beta1, beta2, eps, weight_decay, decoupled)
    if _native is None:
        adam_step_torch(param, grad, exp_avg, exp_avg_sq, h, step=step, grad_scale=grad_scale, clip_coef=clip_coef,
                        param_out=param_out, zero_grad=zero_grad, seed=seed, index_base=index_base,
                        exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale)
        return
    _check_adam(param, grad, exp_avg, exp_avg_sq, param_out, step, (exp_avg_scale, exp_avg_sq_scale))
    if zero_grad and grad.dtype != torch.float32:
        raise ValueError(f"adam_step: zero_grad needs a float32 gradient, found {grad.dtype}")
    _native.adam.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        "none" if param_out is None else _DTYPE_NAMES[param_out.dtype], param.numel(),
        _native_hyper(h), step=int(step), grad_scale=float(grad_scale), clip_coef=float(clip_coef),
        zero_grad=bool(zero_grad), state_dtype=_STATE_NAMES[exp_avg.dtype], seed=int(seed) & 0xFFFFFFFF,
        index_base=int(index_base) & 0xFFFFFFFF,
        exp_avg_scale=0 if exp_avg_scale is None else exp_avg_scale.data_ptr(),
        exp_avg_sq_scale=0 if exp_avg_sq_scale is None else exp_avg_sq_scale.data_ptr(),
    )
