"""The native CRC32C against the pure-Python oracle: the standard check value, odd sizes around the
three-stream block (3 x 8 KiB), chaining, every dtype, and the errors."""

from __future__ import annotations

import pytest
import torch

from zinf import native

needs_native = pytest.mark.skipif(native.checksum_backend() == "python", reason="the native build is missing")


def test_standard_check_value() -> None:
    assert native.crc32c_py(b"123456789") == 0xE3069283
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(b"") == 0


@needs_native
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 24575, 24576, 24577, 3 * 24576 + 13])
def test_native_equals_the_oracle_and_chains(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    want = native.crc32c_py(data)
    assert native.crc32c(data) == want
    k = n // 3
    assert native.crc32c(data[k:], native.crc32c(data[:k])) == want
    assert native.crc32c(bytes(data.numpy())) == want


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_any_dtype_is_checksummed_by_its_bytes(dtype: torch.dtype) -> None:
    t = torch.arange(1000).to(dtype)
    assert native.crc32c(t) == native.crc32c_py(t.view(torch.uint8))
    flipped = t.clone()
    flipped.view(torch.uint8)[17] ^= 1
    assert native.crc32c(flipped) != native.crc32c(t)


@needs_native
def test_strided_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        native.crc32c(torch.zeros(4, 4).t())


@needs_native
@pytest.mark.parametrize("n", [(4 << 20) - 1, 4 << 20, (4 << 20) + 4097, 9 << 20])
def test_threads_give_the_same_checksum(n: int) -> None:
    """Slices checksummed at once and joined (``crc32c_combine``) equal the serial CRC, from any start value."""
    from zinf.native.checksum import crc32c_combine

    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    want = native.crc32c(data)
    for threads in (2, 3, 8):
        assert native.crc32c(data, threads=threads) == want
        assert native.crc32c(data, 0xDEADBEEF, threads=threads) == native.crc32c(data, 0xDEADBEEF)
    k = n // 3
    assert crc32c_combine(native.crc32c(data[:k]), native.crc32c(data[k:]), n - k) == want
