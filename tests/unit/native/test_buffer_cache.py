"""[Note: gather buffer cache] in zinf/native/buffer_cache.py: a storage resized through the cache keeps its identity
(views of it, as autograd saves them, see the new values), a freed block serves the next allocation of its size,
what is kept and in use stays within the bound at every allocation, each engine has a cache of its own (its counts,
its kept blocks, its close), and where the cache cannot be built zinf says why (or refuses, under
``ZINF_REQUIRE_NATIVE=1``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zinf
from zinf.native.buffer_cache import CacheStats, buffer_cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cache is built on Linux only")

MiB = 1 << 20


@pytest.fixture
def cache():
    cache = buffer_cache()
    assert cache is not None, "the gather buffer cache did not build here"
    cache.clear()
    return cache


def test_a_storage_resized_through_the_cache_keeps_its_views(cache) -> None:
    full = torch.empty(0)
    storage = full.untyped_storage()
    cache.resize(storage, 4 * MiB)
    full.set_(storage, 0, (MiB,))
    view = full[10:20].view(2, 5)  # as a parameter's data, and what autograd saves of it
    full.fill_(1.0)
    first = storage.data_ptr()
    before = cache.stats()
    storage.resize_(0)  # the reshard: the block goes back to the cache
    assert cache.stats().cached_bytes == before.cached_bytes + 4 * MiB
    cache.resize(storage, 4 * MiB)  # the next gather: the same block, the same storage
    after = cache.stats()
    assert storage.data_ptr() == first
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)
    full.fill_(2.0)
    assert view.untyped_storage().data_ptr() == first and torch.equal(view, torch.full((2, 5), 2.0))
    storage.resize_(0)


def test_autograd_through_a_resharded_and_regathered_weight(cache) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    ref(x).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None

    full = torch.empty(0)
    storage = full.untyped_storage()
    cache.resize(storage, 32 * 4)
    full.set_(storage, 0, (32,))
    full.copy_(ref.weight.detach().flatten())
    weight = torch.empty(0)
    weight.data = full.view(4, 8)  # as zinf points a parameter at its group's full buffer
    out = torch.nn.functional.linear(x, weight, ref.bias.detach())
    storage.resize_(0)  # resharded between the forward and the backward
    cache.resize(storage, 32 * 4)  # gathered again for the backward: the same storage
    full.copy_(ref.weight.detach().flatten())
    out.square().sum().backward()
    assert torch.equal(x.grad, expected)
    storage.resize_(0)


def test_kept_blocks_stay_within_the_bound(cache) -> None:
    """Kept and in use together: at most 1.25 times the most ever in use at once, plus the largest block."""
    size = max(cache.stats().peak_live_bytes, 8 * MiB)  # two of them in use at once: a new high-water mark
    a, b = torch.empty(0), torch.empty(0)
    cache.resize(a.untyped_storage(), size)
    cache.resize(b.untyped_storage(), size)
    peak = cache.stats().peak_live_bytes
    assert peak >= 2 * size
    a.untyped_storage().resize_(0)
    b.untyped_storage().resize_(0)
    s = cache.stats()
    assert s.cached_bytes >= 2 * size  # both kept
    # blocks of other sizes, larger, one after the other: the least recently freed make room for them
    largest = size
    for nbytes in (size + size // 2, size + 3 * size // 4):
        largest = nbytes
        c = torch.empty(0)
        cache.resize(c.untyped_storage(), nbytes)
        c.untyped_storage().resize_(0)
    s = cache.stats()
    assert s.largest_bytes == largest
    assert s.live_bytes + s.cached_bytes <= s.peak_live_bytes + s.peak_live_bytes // 4 + largest
    assert s.freed >= 1
    cache.clear()
    assert cache.stats().cached_bytes == 0


def _within_bound(s: CacheStats, largest: int) -> bool:
    return s.live_bytes + s.cached_bytes <= s.peak_live_bytes + s.peak_live_bytes // 4 + largest


def test_a_miss_makes_room_before_it_takes_fresh_memory(cache) -> None:
    """Blocks of sizes it does not keep, one at a time, into a cache that is full: each one's fresh memory is made
    room for by the blocks kept longest, so in use and kept together never pass the bound."""
    size = 8 * MiB
    a, b = torch.empty(0), torch.empty(0)
    cache.resize(a.untyped_storage(), size)
    cache.resize(b.untyped_storage(), size)  # the high-water mark: two blocks
    a.untyped_storage().resize_(0)
    b.untyped_storage().resize_(0)
    largest = size
    for k in range(1, 9):  # half a block and a little more each time: never a size it keeps
        nbytes = size // 2 + k * 4096
        largest = max(largest, nbytes)
        t = torch.empty(0)
        cache.resize(t.untyped_storage(), nbytes)
        s = cache.stats()
        assert s.live_bytes == nbytes and _within_bound(s, largest), (k, s)
        t.untyped_storage().resize_(0)
        assert _within_bound(cache.stats(), largest), (k, cache.stats())
    assert cache.stats().freed >= 1


def test_a_closed_cache_keeps_nothing_and_takes_back_its_own_blocks(cache) -> None:
    kept, held = torch.empty(0), torch.empty(0)
    cache.resize(kept.untyped_storage(), MiB)
    cache.resize(held.untyped_storage(), 2 * MiB)
    kept.untyped_storage().resize_(0)
    other = buffer_cache()
    other.resize(kept.untyped_storage(), MiB)  # the storage moves to another cache: its next block is that one's
    cache.close()
    assert (cache.stats().cached_bytes, cache.stats().live_bytes) == (0, 2 * MiB)
    other.resize(held.untyped_storage(), 0)  # a block goes back to the cache it came from, closed: freed
    kept.untyped_storage().resize_(0)
    assert (cache.stats().cached_bytes, cache.stats().live_bytes) == (0, 0)
    assert (other.stats().cached_bytes, other.stats().live_bytes) == (MiB, 0)


def _engine(seed: int) -> zinf.ZeroInfinityEngine:
    """fp32 compute from bf16 shards on one rank: every gather widens into a buffer of the group's own."""
    config = {"precision": "fp32", "param_storage": "bf16", "overlap": {"persistent_numel": 0}}
    torch.manual_seed(seed)
    with zinf.Init(zinf.ZeroConfig.from_dict(config)):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    return zinf.initialize(model, torch.optim.AdamW(model.parameters()), config)


def _step(engine: zinf.ZeroInfinityEngine) -> tuple[int, int]:
    engine.backward(engine(torch.randn(4, 256)).square().mean())
    engine.step()
    counts = engine.report().counts
    return counts["gather_cache_hits"], counts["gather_cache_misses"]


def test_each_engine_counts_keeps_and_clears_its_own_gathers() -> None:
    first = _engine(0)
    steady = [_step(first) for _ in range(3)][-1]  # from the third step on, every step gathers alike
    kept = first.ctx.buffers.stats().cached_bytes
    assert steady[0] > 0 and kept > 0
    second = _engine(1)
    assert _step(second)[1] > 0  # its first gathers take fresh memory: the first engine's kept blocks are its own
    assert _step(first) == steady  # the second engine's gathers are not in the first's counts
    second.close()
    assert first.ctx.buffers.stats().cached_bytes == kept  # closing the second left the first's blocks alone
    first.close()
    assert first.ctx.buffers.stats().cached_bytes == 0


def test_empty_takes_its_memory_from_the_cache(cache) -> None:
    t = cache.empty(1000, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() == 2000
    ptr = t.data_ptr()
    del t
    u = cache.empty(1000, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert u.data_ptr() == ptr


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("from zinf.native.buffer_cache import buffer_cache, unavailable_reason\n"
            "print(buffer_cache() is None, '|', unavailable_reason())")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_without_a_compiler_gathers_fall_back_and_say_why(tmp_path) -> None:
    env = {"CXX": str(tmp_path / "no-such-compiler"), "ZINF_CACHE_DIR": str(tmp_path), "ZINF_REQUIRE_NATIVE": "0"}
    done = _probe(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True |") and "no-such-compiler" in done.stdout, done.stdout
    refused = _probe({**env, "ZINF_REQUIRE_NATIVE": "1"})
    assert refused.returncode != 0 and "gather buffer cache could not be built" in refused.stderr, refused.stderr
