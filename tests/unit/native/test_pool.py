"""PinnedBufferPool: accounting, alignment, exhaustion and no fragmentation over long runs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from zinf import native

pytestmark = pytest.mark.skipif(not native.info().available, reason="zinf._native not built")

MiB = 1 << 20


def test_acquire_release_accounting() -> None:
    pool = native.PinnedBufferPool(16 * MiB)
    assert pool.capacity_bytes == 16 * MiB and pool.bytes_in_use == 0
    a = pool.acquire(MiB)
    b = pool.acquire(5000)  # rounds to an 8192-byte block
    assert a.dtype == torch.uint8 and a.numel() == MiB and b.numel() == 5000
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert pool.bytes_in_use == MiB + 8192
    assert pool.requested_bytes_in_use == MiB + 5000
    f = a.view(torch.float32)
    f.fill_(1.5)
    assert f.numel() == MiB // 4 and float(f.sum()) == 1.5 * MiB / 4
    pool.release(a)
    assert pool.bytes_in_use == 8192
    pool.release(b)
    assert pool.bytes_in_use == 0 and pool.peak_bytes_in_use == MiB + 8192


def test_exhaustion_error() -> None:
    pool = native.PinnedBufferPool(4 * MiB)
    bufs = [pool.acquire(MiB) for _ in range(4)]
    with pytest.raises(native.PoolExhaustedError, match=r"exhausted.*4194304 of 4194304 bytes in use"):
        pool.acquire(1)
    with pytest.raises(MemoryError):
        pool.acquire(8 * MiB)
    pool.release(bufs[0])
    assert pool.acquire(MiB).numel() == MiB


def test_release_foreign_or_twice() -> None:
    pool = native.PinnedBufferPool(MiB)
    t = pool.acquire(4096)
    with pytest.raises(ValueError, match="does not point into this pool"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    pool.release(t)
    with pytest.raises(ValueError, match="not the start of a buffer"):
        pool.release(t)


@pytest.mark.parametrize("capacity", [64 * MiB, 48 * MiB + 12 * 4096])  # power of two and not
def test_no_fragmentation_over_random_cycles(capacity: int) -> None:
    pool = native.PinnedBufferPool(capacity)
    largest_at_start = pool.largest_free_block_bytes
    rng = random.Random(0)
    live: list[torch.Tensor] = []
    for _ in range(20_000):
        if live and (rng.random() < 0.5 or pool.bytes_in_use > capacity * 0.7):
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            n = rng.choice([1, 4095, 4097, 65536, 300_000, MiB, 3 * MiB])
            try:
                t = pool.acquire(n)
            except native.PoolExhaustedError:
                continue
            assert t.data_ptr() % 4096 == 0
            t[:1] = 7
            live.append(t)
    for t in live:
        pool.release(t)
    assert pool.bytes_in_use == 0
    # everything coalesced back: the same largest block as a fresh pool, usable again
    assert pool.largest_free_block_bytes == largest_at_start
    assert pool.acquire(largest_at_start).numel() == largest_at_start


def test_buffers_do_not_overlap() -> None:
    pool = native.PinnedBufferPool(8 * MiB)
    bufs = [pool.acquire(n) for n in (100, 5000, MiB, 70_000, 4096, 2 * MiB)]
    for i, b in enumerate(bufs):
        b.fill_(i)
    for i, b in enumerate(bufs):
        assert bool((b == i).all())


def test_pool_buffers_with_direct_io(tmp_path: Path) -> None:
    pool = native.PinnedBufferPool(8 * MiB)
    src = pool.acquire(3 * MiB + 123)
    src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
    dst = pool.acquire(3 * MiB + 123)
    with native.AsyncIO() as aio:
        aio.wait(aio.submit_write(src, tmp_path / "p.bin"))
        aio.wait(aio.submit_read(dst, tmp_path / "p.bin"))
    assert torch.equal(src, dst)


def test_pin_with_cuda_without_gpu() -> None:
    pool = native.PinnedBufferPool(MiB)
    if torch.cuda.is_available():
        pytest.skip("GPU present: covered by tests/gpu")
    assert pool.pin_with_cuda() is False


def test_tensor_outlives_pool_object() -> None:
    pool = native.PinnedBufferPool(MiB)
    t = pool.acquire(4096)
    del pool  # the tensor's storage keeps the pool's memory alive (buffer protocol reference)
    t.fill_(3)
    assert int(t.sum()) == 3 * 4096


def test_a_pool_over_memory_handed_in(tmp_path: Path) -> None:
    """A pool over a shared mapping (the ranks' shared staging pools): its buffers are that memory, direct reads land
    in it, and the mapping outlives the pool object; a start off the alignment is refused."""
    import mmap

    memory = mmap.mmap(-1, 4 * MiB + 100)  # rounded down to whole alignment units
    pool = native.PinnedBufferPool(8 * MiB, memory=memory)
    assert pool.capacity_bytes == 4 * MiB
    src = pool.acquire(MiB + 7)
    src.copy_(torch.arange(src.numel(), dtype=torch.int64).to(torch.uint8))
    assert src.data_ptr() - torch.frombuffer(memory, dtype=torch.uint8).data_ptr() < 4 * MiB
    start = src.data_ptr() - torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    assert bytes(memory[start : start + 5]) == bytes(range(5))
    dst = pool.acquire(MiB + 7)
    with native.AsyncIO() as aio:
        aio.wait(aio.submit_write(src, tmp_path / "p.bin"))
        aio.wait(aio.submit_read(dst, tmp_path / "p.bin"))
    assert torch.equal(src, dst)
    with pytest.raises(native.PoolExhaustedError):
        pool.acquire(3 * MiB)
    del pool
    dst.fill_(9)  # the buffers' memory is the mapping's, still there
    with pytest.raises(ValueError, match="multiple of the alignment"):
        native.PinnedBufferPool(MiB, memory=memoryview(memory)[64:])
