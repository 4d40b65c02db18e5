"""zinf.native.widen_into ([Note: streaming the widening]): the native widening of bf16 and fp16 to fp32 gives
torch's values bit for bit (infinities, signed zeros, fp16 subnormals; bf16 NaNs with their bits) at every SIMD level
this CPU has, for outputs below and above the streaming size, at unaligned addresses and on several threads. An fp16
NaN, quiet or signalling, comes out a NaN: torch's own bits for one differ between its vector loop and its tail
(0x7fffffff there). What it does not take (overlapping ranges among them) falls back to torch.

``copy_checked`` ([Note: one pass per byte] in zinf/offload/in_place.py): the same widening, or a copy of one dtype,
returning the CRC32C of the source's bytes that ``zinf.native.crc32c`` gives, chained from a seed, on one thread and
on several, and the same from torch's copy where the native loop does not apply."""

from __future__ import annotations

import pytest
import torch

from zinf import native
from zinf.native.widen import copy_checked, widen_into

pytestmark = pytest.mark.skipif(not native.info().available, reason="needs the native extension")
LEVELS = {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(native.info().simd_level, ["scalar"])


def _values(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    low = -30 if dtype == torch.bfloat16 else -7  # fp16 subnormals lie below 6.1e-5
    v = torch.randn(n, generator=g) * torch.logspace(low, 4, max(n, 1))[torch.randperm(max(n, 1), generator=g)][:n]
    v = v.to(dtype)
    if n > 8:
        v[1], v[3], v[5], v[7] = float("inf"), float("-inf"), float("nan"), -0.0
        # signalling NaNs (quiet bit clear, payload set) at the head, the middle and the tail
        snan = [0x7C01, 0xFD55] if dtype == torch.float16 else [0x7F81, 0xFFBF]
        bits = v.view(torch.int16)
        for at in (0, 2, n // 2, n // 2 + 1, n - 2, n - 1):
            bits[at] = snan[at % 2] - 65536 if snan[at % 2] >= 32768 else snan[at % 2]
    return v


def _same(out: torch.Tensor, src: torch.Tensor) -> bool:
    ref = src.float()
    if src.dtype == torch.float16:  # a quiet NaN for a NaN; every other value bit for bit
        nan = ref.isnan()
        quiet = (out.view(torch.int32)[nan] & 0x400000) != 0
        return (torch.equal(nan, out.isnan()) and bool(quiet.all())
                and torch.equal(out.view(torch.int32)[~nan], ref.view(torch.int32)[~nan]))
    return torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.fixture(params=LEVELS)
def level(request):
    before = native.info().simd_level
    native.set_simd_level(request.param)
    yield request.param
    native.set_simd_level(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 15, 17, 4099, (1 << 18) + 5, 3_000_001])  # 1 MiB of fp32 is 2^18 elements
@pytest.mark.parametrize("offset", [0, 3])
def test_widening_gives_torchs_bits(level: str, dtype: torch.dtype, n: int, offset: int) -> None:
    src = _values(n, dtype)
    out = torch.full((n + offset,), 7.0)[offset:]  # offset 3: the start 12 bytes past a 64-byte boundary
    widen_into(out, src)
    assert _same(out, src)


@pytest.mark.parametrize("threads", [2, 3])
def test_several_threads_give_the_same_bits(threads: int) -> None:
    src = _values(3_000_001, torch.float16)
    out = torch.empty(3_000_002)[1:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        widen_into(out, src)
    finally:
        torch.set_num_threads(before)
    assert _same(out, src)


def test_overlapping_ranges_are_refused_as_torch_refuses_them() -> None:
    buf = torch.zeros(1 << 19)
    src = buf[: 1 << 18].view(torch.bfloat16)  # the first half of the fp32 buffer's bytes, as bf16
    with pytest.raises(RuntimeError, match="single memory location"):
        widen_into(buf, src)


def test_the_write_counts_as_one_for_autograd() -> None:
    out = torch.zeros(64)
    before = out._version
    widen_into(out, _values(64, torch.bfloat16))
    assert out._version > before


def test_what_it_does_not_take_is_torchs_copy() -> None:
    src = _values(64, torch.bfloat16)
    strided = torch.zeros(128)[::2]
    widen_into(strided, src)
    assert torch.equal(strided.view(torch.int32), src.float().view(torch.int32))
    doubles = torch.zeros(64, dtype=torch.float64)
    widen_into(doubles, src)
    assert torch.equal(doubles.view(torch.int64), src.double().view(torch.int64))
    same = torch.zeros(64)
    widen_into(same, src.float())
    assert torch.equal(same.view(torch.int32), src.float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("n", [0, 1, 17, 24_577, (1 << 18) + 5, 3_000_001])  # 24,576 bf16: one checksum block
@pytest.mark.parametrize("threads", [1, 3])
def test_the_copy_takes_the_checksum_of_what_it_reads(level: str, dtype: torch.dtype, n: int, threads: int) -> None:
    src = _values(n, torch.bfloat16).view(torch.uint8)[:n].view(dtype) if dtype == torch.uint8 \
        else _values(n, dtype) if dtype != torch.float32 else torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = torch.full((n + 1,), 7.0)[1:] if dtype != torch.uint8 else torch.zeros(n + 1, dtype=torch.uint8)[1:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        crc = copy_checked(out, src, 0x1234)
    finally:
        torch.set_num_threads(before)
    assert crc == native.crc32c(src.reshape(-1).view(torch.uint8), 0x1234)
    assert _same(out, src) if dtype in (torch.bfloat16, torch.float16) else torch.equal(out, src)


def test_a_copy_it_does_not_take_still_checksums() -> None:
    src = _values(64, torch.bfloat16)
    strided = torch.zeros(128)[::2]
    assert copy_checked(strided, src) == native.crc32c(src.view(torch.uint8))
    assert torch.equal(strided.view(torch.int32), src.float().view(torch.int32))


_FEWER_THREADS = """
import torch
from zinf import native
from zinf.native.widen import copy_checked, widen_into
torch.set_num_threads(4)
src = (torch.arange(4 << 20) % 1000).to(torch.bfloat16)
out, wide = torch.zeros(src.numel()), torch.zeros(src.numel())
crc = copy_checked(out, src)
widen_into(wide, src)
assert crc == native.crc32c(src.view(torch.uint8)), "checksum"
assert torch.equal(out, src.float()) and torch.equal(wide, src.float()), "values"
"""


def test_fewer_threads_than_asked_for_still_do_every_slice() -> None:
    """OpenMP may run a region on fewer threads than it was asked for (here ``OMP_THREAD_LIMIT=1`` against four):
    every slice is still widened and checksummed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", _FEWER_THREADS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
