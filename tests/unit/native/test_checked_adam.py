"""The CPU-Adam pass that checksums its inputs and outputs: the same step bit for bit as adam_step, and each
CRC32C equal to crc32c of the whole tensor before (inputs) and after (outputs), on any number of threads."""

import pytest
import torch

from zinf import native
from zinf.native.checked_adam import adam_step_checked, can_check_in_pass

pytestmark = pytest.mark.skipif(native.checksum_backend() == "python", reason="needs the native extension")


def _arrays(n: int, moments: torch.dtype, grads: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g).to(grads)
    m = (torch.randn(n, generator=g) * 0.1).to(moments)
    v = (torch.rand(n, generator=g) * 0.01).to(moments)
    return param, grad, m, v


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 4095, 4096, 70_001, 300_000])
@pytest.mark.parametrize("moments,grads", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16)])
def test_same_step_and_the_whole_tensors_checksums(threads, n, moments, grads):
    hyper = native.AdamHyper(lr=1e-3, weight_decay=0.01, decoupled=True)
    kw = dict(step=3, clip_coef=0.5, seed=7, index_base=11)
    before = native.require().adam.num_threads()
    native.set_num_threads(threads)
    try:
        ref = _arrays(n, moments, grads)
        got = [t.clone() for t in ref]
        expected_in = [native.crc32c(t) for t in (got[0], got[2], got[3], got[1])]
        zero = grads == torch.float32
        native.adam_step(ref[0], ref[1], ref[2], ref[3], hyper, zero_grad=zero, **kw)
        read, written = adam_step_checked(got[0], got[1], got[2], got[3], hyper, zero_grad=zero, grad_checksum=True,
                                          **kw)
    finally:
        native.set_num_threads(before)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert list(read) == expected_in
    assert list(written) == [native.crc32c(t) for t in (got[0], got[2], got[3])]


def test_a_changed_input_changes_its_checksum_only():
    hyper = native.AdamHyper(lr=1e-3)
    clean = _arrays(10_000, torch.float32, torch.float32)
    flipped = [t.clone() for t in clean]
    flipped[2].view(torch.int32)[5000] ^= 1  # one bit of one moment
    a, _ = adam_step_checked(*clean, hyper, step=1, grad_checksum=True)
    b, _ = adam_step_checked(*flipped, hyper, step=1, grad_checksum=True)
    assert [x == y for x, y in zip(a, b)] == [True, False, True, True]


def test_refuses_int8_moments_and_says_what_to_call():
    p, g, m, v = _arrays(512, torch.float32, torch.float32)
    codes = torch.zeros(512, dtype=torch.uint8)
    assert not can_check_in_pass(codes)
    with pytest.raises(RuntimeError, match="adam_step and crc32c apart"):
        adam_step_checked(p, g, codes, codes.clone(), native.AdamHyper(), step=1)


_FEWER_THREADS = """
import torch
from zinf import native
from zinf.native.checked_adam import adam_step_checked
hyper = native.AdamHyper(lr=1e-3)
g = torch.Generator().manual_seed(0)
arrays = [torch.randn(300_000, generator=g) for _ in range(4)]
arrays[3].abs_()
one = [t.clone() for t in arrays]
native.set_num_threads(1)
native.adam_step(*one, hyper, step=2)
native.set_num_threads(4)
four = [t.clone() for t in arrays]
native.adam_step(*four, hyper, step=2)
checked = [t.clone() for t in arrays]
read, written = adam_step_checked(*checked, hyper, step=2, grad_checksum=True)
assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(one, four, checked)), "values"
assert list(read) == [native.crc32c(t) for t in (arrays[0], arrays[2], arrays[3], arrays[1])], "read"
assert list(written) == [native.crc32c(t) for t in (checked[0], checked[2], checked[3])], "written"
"""


def test_fewer_threads_than_asked_for_still_step_every_slice() -> None:
    """OpenMP may run a region on fewer threads than it was asked for (``OMP_THREAD_LIMIT=1`` against four): every
    slice is still stepped (plain and checked passes) and checksummed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", _FEWER_THREADS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
