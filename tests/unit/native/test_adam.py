"""CPU Adam/AdamW kernels against torch.optim.Adam/AdamW, per SIMD level.

Tolerance: fp32 param / exp_avg / exp_avg_sq within rtol=1e-6, atol=1e-7 of torch after several
steps (the kernels use the same operation order as torch's single-tensor path, but torch may fuse
some multiply-adds); the bf16/fp16 copy equals torch's rounding of our fp32 param bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from zinf import native

pytestmark = pytest.mark.skipif(not native.info().available, reason="zinf._native not built")

LEVELS = ["scalar", "avx2", "avx512"]
SIZES = [1, 7, 15, 17, 63, 1000003]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]


def _supported(level: str) -> bool:
    return LEVELS.index(level) <= LEVELS.index(native.require().adam.best_simd_level())


@pytest.fixture(params=LEVELS)
def simd(request: pytest.FixtureRequest) -> Iterator[str]:
    level = request.param
    if not _supported(level):
        pytest.skip(f"CPU lacks {level}")
    before = native.require().adam.simd_level()
    native.set_simd_level(level)
    yield level
    native.set_simd_level(before)


def _run(numel: int, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, decoupled: bool,
         grad_scale: float, clip_coef: float, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(numel)
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    param = torch.randn(numel, generator=gen)
    ref = param.clone().requires_grad_(True)
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = opt_cls([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    hyper = native.AdamHyper.from_param_group(opt.param_groups[0], decoupled=decoupled)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype)
    for step in range(1, steps + 1):
        grad = (torch.randn(numel, generator=gen) * grad_scale).to(grad_dtype)
        ref.grad = grad.to(torch.float32).mul(clip_coef / grad_scale)
        opt.step()
        native.adam_step(param, grad, m, v, hyper, step=step, grad_scale=grad_scale, clip_coef=clip_coef,
                         param_out=out)
    state = opt.state[ref]
    torch.testing.assert_close(param, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-6, atol=1e-7)
    if out is not None:
        assert torch.equal(out.view(torch.int16), param.to(out_dtype).view(torch.int16))


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("grad_dtype,out_dtype", list(itertools.product(GRAD_DTYPES, OUT_DTYPES)))
def test_adamw_matches_torch(simd: str, numel: int, grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    _run(numel, grad_dtype, out_dtype, decoupled=True, grad_scale=1024.0, clip_coef=0.5)


@pytest.mark.parametrize("numel", [17, 1000003])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_adam_l2_matches_torch(simd: str, numel: int, grad_dtype: torch.dtype) -> None:
    _run(numel, grad_dtype, torch.bfloat16, decoupled=False, grad_scale=8.0, clip_coef=0.25)


def test_plain_step_no_scaling(simd: str) -> None:
    _run(1000, torch.float32, None, decoupled=True, grad_scale=1.0, clip_coef=1.0, steps=5)


def _special_values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randn(4000, generator=gen) * torch.logspace(-30, 30, 4000)
    bits = torch.randint(0, 2**31 - 1, (4000,), generator=gen, dtype=torch.int64)
    ties_bf16 = ((bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)  # exact bf16 ties
    ties_f16 = ((torch.randint(0x33000000, 0x47800000, (4000,), generator=gen) & ~0x1FFF) | 0x1000).to(
        torch.int32).view(torch.float32)  # exact fp16 ties, incl. subnormal range
    fp16_edges = torch.tensor([65504.0, 65519.0, 65520.0, 1e5, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 0.0, -0.0,
                               float("inf"), -float("inf"), float("nan")])
    x = torch.cat([rnd, ties_bf16, -ties_bf16, ties_f16, -ties_f16, fp16_edges])
    return x[torch.isfinite(x) | torch.isnan(x) | torch.isinf(x)]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_copy_rounds_like_torch(simd: str, out_dtype: torch.dtype) -> None:
    param = _special_values()
    n = param.numel()
    expected = param.to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    # lr=0, zero grad, no decay: the fp32 param is unchanged, so only the conversion is tested.
    native.adam_step(param, torch.zeros(n), torch.zeros(n), torch.zeros(n), native.AdamHyper(lr=0.0, decoupled=True),
                     step=1, param_out=out)
    nan = torch.isnan(expected)  # NaN payloads differ between torch's own scalar and vector paths
    assert torch.isnan(out[nan]).all()
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("numel", [1, 17, 63, 1000003])
def test_grad_norm_sq(simd: str, dtype: torch.dtype, numel: int) -> None:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    total, finite = native.grad_norm_sq(g)
    ref = float(g.double().square().sum())
    assert finite
    assert total == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 40, 1000002])  # vector body, another body lane, scalar tail
def test_grad_norm_sq_detects_non_finite(simd: str, dtype: torch.dtype, bad: float, where: int) -> None:
    g = torch.randn(1000003, generator=torch.Generator().manual_seed(2)).to(dtype)
    g[where] = bad
    _, finite = native.grad_norm_sq(g)
    assert not finite


def test_fp16_overflow_is_non_finite() -> None:
    g = torch.full((100,), 70000.0).to(torch.float16)  # overflows to inf in fp16
    assert native.grad_norm_sq(g)[1] is False
    assert native.grad_norm_sq(torch.full((100,), 60000.0).to(torch.float16))[1] is True


def test_fallback_matches_native() -> None:
    n = 1000
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    tensors = [p.clone(), torch.zeros(n), torch.zeros(n)]
    ref = [p.clone(), torch.zeros(n), torch.zeros(n)]
    out, out_ref = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    hyper = native.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, decoupled=False)
    native.adam_step(tensors[0], g, tensors[1], tensors[2], hyper, step=1, grad_scale=2.0, clip_coef=0.7, param_out=out)
    native.adam_step_torch(ref[0], g, ref[1], ref[2], native.PythonAdamHyper(1e-3, 0.9, 0.99, 1e-8, 0.01, False),
                           step=1, grad_scale=2.0, clip_coef=0.7, param_out=out_ref)
    for a, b in zip(tensors, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert native.grad_norm_sq_torch(g)[0] == pytest.approx(native.grad_norm_sq(g)[0], rel=1e-12)


def test_validation_messages() -> None:
    p = torch.zeros(10)
    kw = dict(hyper=native.AdamHyper(lr=1e-3, beta2=0.99, decoupled=True), step=1)
    with pytest.raises(ValueError, match=r"exp_avg.*float32.*10 elements.*numel=9"):
        native.adam_step(p, torch.zeros(10), torch.zeros(9), torch.zeros(10), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`param`.*dtype=float64"):
        native.adam_step(p.double(), torch.zeros(10), torch.zeros(10), torch.zeros(10), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`grad`.*contiguous=False"):
        native.adam_step(p, torch.zeros(20)[::2], torch.zeros(10), torch.zeros(10), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"param_out"):
        native.adam_step(p, torch.zeros(10), torch.zeros(10), torch.zeros(10), param_out=torch.zeros(10),
                         **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step >= 1"):
        native.adam_step(p, torch.zeros(10), torch.zeros(10), torch.zeros(10), **{**kw, "step": 0})  # type: ignore[arg-type]


def test_info_and_forced_level() -> None:
    i = native.info()
    assert i.available and i.error is None and i.num_threads >= 1
    assert i.simd_level in LEVELS
    with pytest.raises(ValueError, match="unknown SIMD level"):
        native.set_simd_level("sse9")


def test_zero_grad_in_the_same_pass_changes_no_number(simd: str) -> None:
    n = 1037  # a SIMD body and a scalar tail
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = [t.clone() for t in (p, g, m, v)]
    out, ref_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    h = native.AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=True)
    native.adam_step(p, g, m, v, h, step=1, clip_coef=0.5, param_out=out, zero_grad=True)
    native.adam_step(*ref, h, step=1, clip_coef=0.5, param_out=ref_out)
    assert torch.equal(p, ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3]) and torch.equal(out, ref_out)
    assert not g.any() and ref[1].any()


def test_zero_grad_needs_a_float32_gradient() -> None:
    n = 64
    with pytest.raises(ValueError, match="zero_grad needs a float32 gradient"):
        native.adam_step(torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n),
                         native.AdamHyper(), step=1, zero_grad=True)
