"""zinf.native.four_bit against bitsandbytes on the CPU: the codes and block scales of ``quantize_4bit`` and the
values of ``dequantize_4bit`` bit for bit (NF4 and FP4, partial last blocks, odd counts, all-zero blocks), from the
C++ kernels and from their torch twins (what runs without the extension)."""

from __future__ import annotations

import pytest
import torch

from zinf import native
from zinf.native import four_bit
from zinf.param.four_bit import CODES

bnb_f = pytest.importorskip("bitsandbytes.functional")

SIZES = (4096, 64 * 5 + 17, 7, 1, 128 * 3 + 1)


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
    if n >= 128:
        v[64:128] = 0  # a block of zeros
    return v


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setattr(four_bit, "_native", None)
    elif four_bit._native is None:
        pytest.skip("the zinf C++ extension is not built")
    return request.param


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("n", SIZES)
def test_encode_is_bitsandbytes_quantize_4bit(kernels: str, quant_type: str, n: int) -> None:
    v = _values(n, n)
    packed, absmax = four_bit.encode(v, 64, CODES[quant_type])
    theirs, state = bnb_f.quantize_4bit(v, blocksize=64, quant_type=quant_type)
    assert torch.equal(packed, theirs.reshape(-1))
    assert torch.equal(absmax, state.absmax)
    assert torch.equal(four_bit.block_absmax(v, 64), state.absmax)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_bitsandbytes_dequantize_4bit(kernels: str, quant_type: str, dtype: torch.dtype) -> None:
    v = _values(64 * 40, 3)
    packed, state = bnb_f.quantize_4bit(v, blocksize=64, quant_type=quant_type)
    out = torch.empty(v.numel(), dtype=dtype)
    four_bit.decode(packed.reshape(-1), state.absmax, out, 64, CODES[quant_type])
    expected = bnb_f.dequantize_4bit(packed, state).reshape(-1).to(dtype)  # fp32 products, then torch's cast
    assert torch.equal(out, expected)


LEVELS = {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(native.info().simd_level, [])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize,blocks", [(64, 40), (32, 7), (128, 3), (256, 1)])
def test_each_simd_level_decodes_bitsandbytes_bits(level: str, quant_type: str, blocksize: int, blocks: int) -> None:
    """The AVX-512 and AVX2 loops (a codebook permute, then the multiply) give the scalar loop's bits: fp32, block
    sizes bitsandbytes takes, on one thread and on two (blocks split between them)."""
    v = _values(blocksize * blocks, blocksize)
    packed, state = bnb_f.quantize_4bit(v, blocksize=blocksize, quant_type=quant_type)
    expected = bnb_f.dequantize_4bit(packed, state).reshape(-1)
    before, threads = native.info().simd_level, torch.get_num_threads()
    native.set_simd_level(level)
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = torch.full((v.numel(),), float("nan"))
            four_bit.decode(packed.reshape(-1), state.absmax, out, blocksize, CODES[quant_type])
            assert torch.equal(out, expected), (level, t)
    finally:
        native.set_simd_level(before)
        torch.set_num_threads(threads)


def test_the_codebooks_are_bitsandbytes() -> None:
    for quant_type, code in CODES.items():
        assert torch.equal(torch.tensor(code, dtype=torch.float32), bnb_f.get_4bit_type(quant_type, device="cpu"))
