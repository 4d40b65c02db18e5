"""zinf's native core: the C++ extension ``zinf._native`` and a pure-Python fallback for each part.

Public API used by the offload engine and the optimizer (``from zinf import native``):

- :func:`info` / :class:`NativeInfo`: whether the extension loaded, its SIMD level, I/O backend.
- :func:`require`: raise a clear ``ImportError`` (with the build command) when it did not.
- :class:`AdamHyper`, :func:`adam_step`, :func:`grad_norm_sq`: fused CPU Adam/AdamW and squared gradient norm.
- :class:`AsyncIO`: asynchronous file reads/writes of tensors (io_uring or threads, O_DIRECT).
- :class:`PinnedBufferPool`: a fixed-capacity aligned host buffer pool handing out uint8 tensors.
- :func:`crc32c`: the CRC32C content checksum of a tensor's bytes (SSE4.2 where the CPU has it).
- :mod:`.shm`: flags in shared memory for the collectives of ranks on one host.
- :mod:`.fault`: the one line a process killed by a fatal signal writes (its rank, thread and phase).

One module per job, each beside the stub of the extension submodule it wraps:

- :mod:`.loader`: loads the extension (``ZINF_REQUIRE_NATIVE``), ``info``, ``require``, thread/SIMD settings.
- :mod:`.adam` (``_native_adam.pyi``): ``AdamHyper``, ``adam_step``, ``grad_norm_sq``, ``stream_bound``.
- :mod:`.aio` (``_native_aio.pyi``): ``AsyncIO``, ``PythonAsyncIO``, the ``AIOError`` family.
- :mod:`.pool` (``_native_pool.pyi``): ``PinnedBufferPool``, ``PoolExhaustedError``.
- :mod:`.checksum` (``_native_checksum.pyi``): ``crc32c``, ``crc32c_py``, ``checksum_backend``.
- :mod:`.widen` (``_native_convert.pyi``): ``widen_into``, bf16/fp16 to fp32 (fallback: torch's copy).
- :mod:`.shm` (``_native_shm.pyi``): ``post``, ``wait_all``, ``mark_closed`` (no fallback: without the extension, ``available()`` is False).
- :mod:`.fault` (``_native_fault.pyi``): ``install``, ``phase``, ``describe`` (fallback: Python's faulthandler, which
  names no rank or phase).

Every native entry point has a pure-PyTorch fallback with the same signature (``*_torch`` /
``Python*`` / ``*_py``); they are used when the extension is missing and serve as test oracles.
Set ``ZINF_REQUIRE_NATIVE=1`` to make a missing or broken extension an error at import time.
"""

from __future__ import annotations

from .adam import (
    AdamHyper,
    AdamHyperLike,
    PythonAdamHyper,
    adam_step,
    adam_step_torch,
    grad_factor,
)
from .grad_norm import grad_norm_sq, grad_norm_sq_torch, stream_bound
from .aio import AIOError, AIOMissingPathError, AIONoSpaceError, AIOShortReadError, AsyncIO, PythonAsyncIO
from .checksum import checksum_backend, crc32c, crc32c_py
from .loader import _BUILD_HINT as _BUILD_HINT  # noqa: F401  (re-exported: zinf.offload.swap reads native._BUILD_HINT)
from .loader import NativeInfo, info, require, set_num_threads, set_simd_level
from .pool import PinnedBufferPool, PoolExhaustedError

__all__ = [
    "AIOError",
    "AIOMissingPathError",
    "AIONoSpaceError",
    "AIOShortReadError",
    "AdamHyper",
    "AdamHyperLike",
    "AsyncIO",
    "NativeInfo",
    "PinnedBufferPool",
    "PoolExhaustedError",
    "PythonAdamHyper",
    "PythonAsyncIO",
    "adam_step",
    "adam_step_torch",
    "crc32c",
    "crc32c_py",
    "checksum_backend",
    "grad_factor",
    "grad_norm_sq",
    "grad_norm_sq_torch",
    "info",
    "require",
    "set_num_threads",
    "set_simd_level",
    "stream_bound",
]
