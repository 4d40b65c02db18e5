"""[Note: gather buffer cache] in zinf/native/buffer_cache.py: a storage resized through the cache keeps its identity
(views of it, as autograd saves them, see the new values), a freed block serves the next allocation of its size,
what is kept stays within the most ever in use at once, and where the cache cannot be built zinf says why (or
refuses, under ``ZINF_REQUIRE_NATIVE=1``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from zinf.native.buffer_cache import buffer_cache

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
    # blocks of another size, larger: the least recently freed make room for them
    c, d = torch.empty(0), torch.empty(0)
    cache.resize(c.untyped_storage(), size + size // 2)
    cache.resize(d.untyped_storage(), size + size // 2)
    c.untyped_storage().resize_(0)
    d.untyped_storage().resize_(0)
    s = cache.stats()
    largest = size + size // 2
    assert s.live_bytes + s.cached_bytes <= s.peak_live_bytes + s.peak_live_bytes // 4 + largest
    assert s.freed >= 1
    cache.clear()
    assert cache.stats().cached_bytes == 0


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
