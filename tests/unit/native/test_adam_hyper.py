"""AdamHyper: one hyper-parameter type for Python and the binding.

The native ``zinf._native.adam.AdamHyper`` (C++ struct) and the pure-Python ``PythonAdamHyper`` have the
same fields, constructor and ``from_param_group``; ``adam_step`` gives bit-identical results for either
(and for the legacy keyword form), and the fallback (``adam_step_torch``) matches within the Adam tests'
tolerance. The subprocess test checks the package without the extension.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import textwrap

import numpy as np
import pytest
import torch

from zinf import native
import processes

needs_native = pytest.mark.skipif(not native.info().available, reason="zinf._native not built")

FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled")
HYPER_TYPES = [native.AdamHyper, native.PythonAdamHyper]


def _fields(h: object) -> tuple[object, ...]:
    return tuple(getattr(h, k) for k in FIELDS)


@pytest.mark.parametrize("cls", HYPER_TYPES)
def test_constructor_defaults_and_conversions(cls: type) -> None:
    assert _fields(cls()) == (1e-3, 0.9, 0.999, 1e-8, 0.0, False)  # torch.optim.Adam's defaults
    h = cls(2e-3, 0.8, 0.95, 1e-6, 0.1, True)
    assert _fields(h) == (2e-3, 0.8, 0.95, 1e-6, 0.1, True)
    assert h == cls(lr=2e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=True)
    assert h != cls(lr=2e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=False)
    ints = cls(1, 0, 0, 0, 0, 1)  # ints become floats, the flag a bool
    assert all(type(getattr(ints, k)) is float for k in FIELDS[:-1]) and ints.decoupled is True
    assert type(cls(lr=torch.tensor(0.5)).lr) is float  # a tensor lr (torch allows one) is read as a float
    with pytest.raises(AttributeError):
        h.lr = 1.0  # read-only, like a frozen dataclass
    assert copy.deepcopy(h) == h and pickle.loads(pickle.dumps(h)) == h
    assert hash(h) == hash(copy.copy(h))
    assert repr(h).endswith("(lr=0.002, beta1=0.8, beta2=0.95, eps=1e-06, weight_decay=0.1, decoupled=True)")


@needs_native
def test_native_type_is_the_binding_struct() -> None:
    assert isinstance(native.AdamHyper(), native.require().adam.AdamHyper)
    assert native.AdamHyper is not native.PythonAdamHyper


@pytest.mark.parametrize("cls", HYPER_TYPES)
def test_from_param_group(cls: type) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([p], lr=3e-4, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05)
    h = cls.from_param_group(adamw.param_groups[0], decoupled=isinstance(adamw, torch.optim.AdamW))
    assert type(h) is cls
    assert _fields(h) == (3e-4, 0.85, 0.98, 1e-7, 0.05, True)
    adam = torch.optim.Adam([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    assert _fields(cls.from_param_group(adam.param_groups[0], decoupled=False)) == (1e-2, 0.9, 0.99, 1e-8, 0.1, False)
    # Adam(decoupled_weight_decay=True) is AdamW whatever the caller says
    adam_dwd = torch.optim.Adam([p], lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    assert cls.from_param_group(adam_dwd.param_groups[0], decoupled=False).decoupled is True
    # a plain dict (no decoupled_weight_decay key), tensor lr and betas
    group = {"lr": torch.tensor(0.25), "betas": (torch.tensor(0.5), 0.75), "eps": 1e-3, "weight_decay": 0}
    assert _fields(cls.from_param_group(group, decoupled=False)) == (0.25, 0.5, 0.75, 1e-3, 0.0, False)


def _tensors(n: int, seed: int, grad_dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).mul(512.0).to(grad_dtype)
    return [p, g, torch.rand(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01]


def _step(fn, hyper, n: int = 1003, grad_dtype: torch.dtype = torch.bfloat16, **kw) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    p, g, m, v = _tensors(n, 7, grad_dtype)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2, 3):
        fn(p, g, m, v, hyper, step=step, grad_scale=512.0, clip_coef=0.3, param_out=out, **kw)
    return [p, m, v, out]


@pytest.mark.parametrize("decoupled", [True, False])
def test_hyper_kinds_and_keyword_form_agree(decoupled: bool) -> None:
    args = (1e-2, 0.9, 0.99, 1e-8, 0.05, decoupled)
    ref = _step(native.adam_step, native.AdamHyper(*args))
    for other in (_step(native.adam_step, native.PythonAdamHyper(*args)),  # converted to the native struct
                  _step(native.adam_step, None, **dict(zip(FIELDS, args)))):  # legacy keywords
        for a, b in zip(ref, other):
            assert torch.equal(a, b)
    # the pure-PyTorch fallback, with either hyper type, within the Adam tests' tolerance
    for cls in HYPER_TYPES:
        fallback = _step(native.adam_step_torch, cls(*args))
        for a, b in zip(ref[:3], fallback[:3]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_hyper_argument_errors() -> None:
    p, g, m, v = _tensors(4, 0, torch.float32)
    for fn in (native.adam_step, native.adam_step_torch):
        with pytest.raises(TypeError, match="not both"):
            fn(p, g, m, v, native.AdamHyper(), step=1, lr=1e-3)
        with pytest.raises(TypeError, match="missing hyper-parameters beta2, eps"):
            fn(p, g, m, v, step=1, lr=1e-3, beta1=0.9, weight_decay=0.0, decoupled=True)


@pytest.mark.parametrize("grad_scale,clip_coef", [(1.0, 1.0), (1024.0, 0.37), (3.0, 1.0), (1.0, 1 / 3), (65536.0, 1e-3)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_grad_factor_is_one_float32_multiply(grad_scale: float, clip_coef: float, grad_dtype: torch.dtype) -> None:
    """adam_step(grad, grad_scale, clip_coef) == adam_step(float32(grad) * grad_factor(...)), bit for bit."""
    f = native.grad_factor(grad_scale, clip_coef)
    assert f == float(np.float32(clip_coef / grad_scale))
    hyper = native.AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=False)
    for fn in (native.adam_step, native.adam_step_torch):
        p, g, m, v = _tensors(257, 3, grad_dtype)
        q, mq, vq = p.clone(), m.clone(), v.clone()
        fn(p, g, m, v, hyper, step=2, grad_scale=grad_scale, clip_coef=clip_coef)
        prescaled = g.to(torch.float32) * torch.tensor(f, dtype=torch.float32)
        fn(q, prescaled, mq, vq, hyper, step=2)
        for a, b in ((p, q), (m, mq), (v, vq)):
            assert torch.equal(a, b)


def test_without_the_extension() -> None:
    """With zinf._native unimportable, AdamHyper is PythonAdamHyper and adam_step runs the fallback."""
    code = textwrap.dedent("""
        import sys
        sys.modules["zinf._native"] = None  # import of zinf._native now raises ImportError
        import torch
        from zinf import native
        assert not native.info().available
        assert native.AdamHyper is native.PythonAdamHyper
        p = torch.nn.Parameter(torch.randn(5))
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
        h = native.AdamHyper.from_param_group(opt.param_groups[0], decoupled=True)
        assert h == native.PythonAdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True)
        x, m, v = p.detach().clone(), torch.zeros(5), torch.zeros(5)
        p.grad = torch.ones(5)
        opt.step()
        native.adam_step(x, torch.ones(5), m, v, h, step=1)
        torch.testing.assert_close(x, p.detach(), rtol=1e-6, atol=1e-7)
        print("ok")
    """)
    env = {k: val for k, val in os.environ.items() if k != "ZINF_REQUIRE_NATIVE"}
    res = processes.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
