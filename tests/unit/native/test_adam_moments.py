"""bf16 moments in the CPU-Adam kernel ([Note: bf16 moments] in cpp/adam/kernel_scalar_body.h): the stored moments
equal the pure-PyTorch twin's at every SIMD level and are the same on every level; the stochastic rounding keeps a
moment's expected value, so exp_avg_sq decays where rounding to nearest would hold it still."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from zinf import native
from zinf.native import moment_codes
from zinf.native.rounding import sr_bits, stochastic_bf16

pytestmark = pytest.mark.skipif(not native.info().available, reason="zinf._native not built")

LEVELS = ["scalar", "avx2", "avx512"]
SIZES = [1, 15, 17, 1000003]


def _supported(level: str) -> bool:
    return LEVELS.index(level) <= LEVELS.index(native.require().adam.best_simd_level())


@pytest.fixture(params=LEVELS)
def simd(request: pytest.FixtureRequest) -> Iterator[str]:
    if not _supported(request.param):
        pytest.skip(f"CPU lacks {request.param}")
    before = native.require().adam.simd_level()
    native.set_simd_level(request.param)
    yield request.param
    native.set_simd_level(before)


def _steps(numel: int, steps: int = 3, seed: int = 7, index_base: int = 1000,
           torch_twin: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen)
    m = torch.zeros(numel, dtype=torch.bfloat16)
    v = torch.zeros(numel, dtype=torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    hyper = native.AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=True)
    step_fn = native.adam_step_torch if torch_twin else native.adam_step
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen).to(torch.bfloat16)
        step_fn(param, grad, m, v, hyper, step=step, param_out=out, seed=seed + step, index_base=index_base)
    return param, m, v, out


@pytest.mark.parametrize("numel", SIZES)
def test_bf16_moments_equal_the_torch_twin(simd: str, numel: int) -> None:
    param, m, v, out = _steps(numel)
    ref = _steps(numel, torch_twin=True)
    # the moments are computed alike in fp32 and rounded with the same bits; the parameter may differ in its last
    # bit where torch's vectorised sqrt is not correctly rounded (tests/unit/native/test_adam.py)
    assert torch.equal(m.view(torch.int16), ref[1].view(torch.int16))
    assert torch.equal(v.view(torch.int16), ref[2].view(torch.int16))
    torch.testing.assert_close(param, ref[0], rtol=1e-6, atol=1e-7)


def test_every_simd_level_stores_the_same_moments() -> None:
    results = {}
    before = native.require().adam.simd_level()
    try:
        for level in filter(_supported, LEVELS):
            native.set_simd_level(level)
            results[level] = _steps(100_003)
    finally:
        native.set_simd_level(before)
    first = next(iter(results.values()))
    for level, (param, m, v, _) in results.items():
        assert torch.equal(m.view(torch.int16), first[1].view(torch.int16)), level
        assert torch.equal(v.view(torch.int16), first[2].view(torch.int16)), level


def test_the_rounding_bits_depend_on_seed_and_index() -> None:
    _, m1, _, _ = _steps(4096, seed=1)
    _, m2, _, _ = _steps(4096, seed=2)
    _, m3, _, _ = _steps(4096, seed=1, index_base=0)
    assert not torch.equal(m1, m2) and not torch.equal(m1, m3)
    bits = sr_bits(5, torch.arange(1 << 16))
    assert 0.49 < (bits & 1).float().mean().item() < 0.51 and 0.49 < (bits >> 31).float().mean().item() < 0.51


def test_stochastic_rounding_keeps_the_expected_value() -> None:
    x = torch.full((1 << 16,), 1.0 + 2.0**-10)  # an eighth of a bf16 unit (2^-7) above 1.0
    rounded = stochastic_bf16(x, sr_bits(3, torch.arange(x.numel())) & 0xFFFF).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-4  # nearest rounding would give 1.0 everywhere
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    out = stochastic_bf16(special, torch.full((5,), 0xFFFF, dtype=torch.int64)).float()
    assert out[0].isnan() and out[1:3].tolist() == [float("inf"), -float("inf")] and out[3:].tolist() == [0.0, 0.0]


def test_exp_avg_sq_decays_in_bf16() -> None:
    """After one large gradient, zero gradients: fp32 exp_avg_sq falls by 0.1% a step. In bf16 rounded to nearest
    it would never move (the change is under half a unit); stochastically rounded it follows fp32 within 2%."""
    n, steps = 4096, 500
    param32, m32, v32 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    param16, m16, v16 = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    hyper = native.AdamHyper(lr=1e-3)
    for step in range(1, steps + 1):
        grad = torch.ones(n) if step == 1 else torch.zeros(n)
        native.adam_step(param32, grad, m32, v32, hyper, step=step)
        native.adam_step(param16, grad, m16, v16, hyper, step=step, seed=step)
    expected = 0.001 * 0.999 ** (steps - 1)
    nearest = torch.tensor(0.001).bfloat16()
    assert (nearest.float() * 0.999).bfloat16() == nearest  # rounded to nearest, the decay is lost
    assert abs(v32.mean().item() / expected - 1) < 1e-3
    assert abs(v16.float().mean().item() / expected - 1) < 0.02
    torch.testing.assert_close(param16, param32, rtol=0.02, atol=1e-6)


def test_moments_of_mixed_dtypes_are_refused() -> None:
    n = 8
    with pytest.raises(ValueError, match="exp_avg_sq.*bfloat16"):
        native.adam_step(torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n),
                         native.AdamHyper(), step=1)
    with pytest.raises(ValueError, match="exp_avg.*float32/bfloat16"):
        native.adam_step(torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.float16),
                         torch.zeros(n, dtype=torch.float16), native.AdamHyper(), step=1)


# -- int8 moments ([Note: int8 moments] in cpp/adam/int8_moments.h) ------------------------------------------------
def _int8_steps(numel: int, steps: int = 3, torch_twin: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen)
    m, v = torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8)
    me = torch.full((moment_codes.blocks(numel),), moment_codes.ZERO_BLOCK, dtype=torch.int8)
    ve = me.clone()
    hyper = native.AdamHyper(lr=1e-2, weight_decay=0.1, decoupled=True)
    step_fn = native.adam_step_torch if torch_twin else native.adam_step
    for step in range(1, steps + 1):
        grad = torch.randn(numel, generator=gen) * (10.0 ** -(step % 3))  # scales move between steps
        step_fn(param, grad, m, v, hyper, step=step, seed=step, index_base=77, exp_avg_scale=me, exp_avg_sq_scale=ve)
    return param, m, v, me, ve


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 100_003])
def test_int8_moments_equal_the_torch_twin(simd: str, numel: int) -> None:
    got, ref = _int8_steps(numel), _int8_steps(numel, torch_twin=True)
    for a, b in zip(got[1:], ref[1:]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)


def test_every_simd_level_stores_the_same_int8_moments() -> None:
    results = []
    before = native.require().adam.simd_level()
    try:
        for level in filter(_supported, LEVELS):
            native.set_simd_level(level)
            results.append(_int8_steps(100_003)[1:])
    finally:
        native.set_simd_level(before)
    assert all(torch.equal(a, b) for r in results for a, b in zip(r, results[0]))


def test_decoded_int8_moments_encode_to_the_same_bytes() -> None:
    """What a checkpoint holds (the decoded values) gives back the same codes and exponents, whatever the rounding
    bits: the resume is exact."""
    _, m, v, me, ve = _int8_steps(100_003, steps=5)
    for name, codes, exps in (("exp_avg", m, me), ("exp_avg_sq", v, ve)):
        again = moment_codes.encode(name, moment_codes.decode(name, codes, exps), seed=12345, index_base=9)
        assert torch.equal(again[0], codes) and torch.equal(again[1], exps), name


def test_int8_moments_keep_the_expected_value_and_never_zero_a_positive_v() -> None:
    n = 1 << 16
    values = torch.full((n,), 0.3)  # between the codes of 0.28125 and 0.3125 (scale 1)
    values[0] = 1.0
    codes, exps = moment_codes.encode("exp_avg", values, seed=1, index_base=0)
    decoded = moment_codes.decode("exp_avg", codes, exps)[1:]
    assert set(decoded.unique().tolist()) == {0.28125, 0.3125}
    assert abs(decoded.mean().item() - 0.3) < 1e-3
    tiny = torch.full((256,), 1e-30)
    tiny[0] = 1.0  # 1e-30 is far below the smallest code of its block
    codes, exps = moment_codes.encode("exp_avg_sq", tiny, seed=1, index_base=0)
    assert (codes[1:] == 1).all() and (moment_codes.decode("exp_avg_sq", codes, exps)[1:] > 0).all()


def test_exp_avg_sq_decays_in_int8() -> None:
    n, steps = 4096, 500
    param32, m32, v32 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    param8 = torch.zeros(n)
    m8, v8 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    me = torch.full((moment_codes.blocks(n),), moment_codes.ZERO_BLOCK, dtype=torch.int8)
    ve = me.clone()
    hyper = native.AdamHyper(lr=1e-3)
    for step in range(1, steps + 1):
        grad = torch.ones(n) if step == 1 else torch.zeros(n)
        native.adam_step(param32, grad, m32, v32, hyper, step=step)
        native.adam_step(param8, grad, m8, v8, hyper, step=step, seed=step, exp_avg_scale=me, exp_avg_sq_scale=ve)
    expected = 0.001 * 0.999 ** (steps - 1)
    assert abs(moment_codes.decode("exp_avg_sq", v8, ve).mean().item() / expected - 1) < 0.02
    # each element's path is noisy (3 mantissa bits, rounded stochastically), their mean follows fp32's
    assert abs(param8.mean().item() / param32.mean().item() - 1) < 0.02


def test_int8_moments_need_their_exponents() -> None:
    n = 8
    codes = torch.zeros(n, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int8 moments.*need `exp_avg_scale`"):
        native.adam_step(torch.zeros(n), torch.zeros(n), codes, codes.clone(), native.AdamHyper(), step=1)


def _int8_step(grad: torch.Tensor, hyper: native.AdamHyper, seed: int, torch_twin: bool = False,
               ) -> tuple[torch.Tensor, ...]:
    """One step from zero int8 moments: (exp_avg codes, exponents, exp_avg_sq codes, exponents)."""
    n = grad.numel()
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    me = torch.full((moment_codes.blocks(n),), moment_codes.ZERO_BLOCK, dtype=torch.int8)
    ve = me.clone()
    step_fn = native.adam_step_torch if torch_twin else native.adam_step
    step_fn(torch.zeros(n), grad, m, v, hyper, step=1, seed=seed, exp_avg_scale=me, exp_avg_sq_scale=ve)
    return m, me, v, ve


def test_int8_moments_past_the_largest_scale_keep_their_value(simd: str) -> None:
    """A block whose largest moment is past 2^127 (fp32 reaches 2^128) takes the largest scale, 2^127, with codes
    up to 1.875: its values keep 3 bits of mantissa instead of all being clipped to 2^127; past 1.875 * 2^127 a value
    saturates there. Both moments, in the kernel at every SIMD level and in the torch twin alike."""
    g = torch.linspace(1.3e19, 1.8e19, 256)  # exp_avg_sq = g^2 (beta2 0): 1.7e38 to 3.24e38
    got = _int8_step(g, native.AdamHyper(lr=1e-3, beta1=0.0, beta2=0.0), seed=5)
    ref = _int8_step(g, native.AdamHyper(lr=1e-3, beta1=0.0, beta2=0.0), seed=5, torch_twin=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert got[3].tolist() == [127]
    v = moment_codes.decode("exp_avg_sq", got[2], got[3]).double()
    want = (g.double() ** 2).clamp(max=1.875 * 2.0**127)
    err = (v / want - 1).abs().max().item()
    assert err < 0.125 and bool(torch.isfinite(v).all()), err
    huge = torch.linspace(-3.3e38, 3.3e38, 256, dtype=torch.float64).float()  # exp_avg = g (beta1 0)
    m, me, _, _ = _int8_step(huge, native.AdamHyper(lr=1e-3, beta1=0.0, beta2=0.5), seed=5)
    twin = _int8_step(huge, native.AdamHyper(lr=1e-3, beta1=0.0, beta2=0.5), seed=5, torch_twin=True)
    assert torch.equal(m, twin[0]) and me.tolist() == twin[1].tolist() == [127]
    m_values = moment_codes.decode("exp_avg", m, me).double()
    want = huge.double().clamp(-1.875 * 2.0**127, 1.875 * 2.0**127)
    big = want.abs() > 2.0**120
    err = (m_values[big] / want[big] - 1).abs().max().item()
    assert err < 0.125, err
    for name, codes, exps in (("exp_avg", m, me), ("exp_avg_sq", got[2], got[3])):  # one encoding per value
        again = moment_codes.encode(name, moment_codes.decode(name, codes, exps), seed=99, index_base=3)
        assert torch.equal(again[0], codes) and torch.equal(again[1], exps), name


def test_an_int8_block_of_zeros_has_one_encoding(simd: str) -> None:
    """Moments so small that every code of their block rounds to 0 are stored as a zero block, the same bytes as a
    block that was never stepped: equal states, equal bytes (checkpoints compared bytewise, exact resumes)."""
    tiny = torch.tensor([2.0**-149, -(2.0**-149), 2.0**-149, 0.0])  # exp_avg = g (beta1 0); exp_avg_sq underflows
    zero = (torch.zeros(4, dtype=torch.uint8), torch.tensor([moment_codes.ZERO_BLOCK], dtype=torch.int8))
    zeroed = 0
    for seed in range(8):
        m, me, v, ve = _int8_step(tiny, native.AdamHyper(lr=0.0, beta1=0.0, beta2=0.999), seed=seed)
        ref = _int8_step(tiny, native.AdamHyper(lr=0.0, beta1=0.0, beta2=0.999), seed=seed, torch_twin=True)
        assert all(torch.equal(a, b) for a, b in zip((m, me, v, ve), ref)), seed
        assert torch.equal(v, zero[0]) and torch.equal(ve, zero[1])
        if not bool(moment_codes.decode("exp_avg", m, me).any()):
            zeroed += 1
            assert torch.equal(m, zero[0]) and torch.equal(me, zero[1]), (seed, m, me)
    assert zeroed > 0  # most seeds round every code to 0
    codes, exps = moment_codes.encode("exp_avg", tiny, seed=0, index_base=0)
    assert not codes.any() and exps.tolist() == [moment_codes.ZERO_BLOCK]
