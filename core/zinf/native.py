"""The one place that loads zinf's C++ extension (``zinf._native``) and reports what was built.

Public API used by the offload engine and the optimizer:

- :func:`info` / :class:`NativeInfo`: whether the extension loaded, its SIMD level, I/O backend.
- :func:`require`: raise a clear ``ImportError`` (with the build command) when it did not.
- :func:`adam_step`, :func:`grad_norm_sq`: fused CPU Adam/AdamW and squared gradient norm.
- :class:`AsyncIO`: asynchronous file reads/writes of tensors (io_uring or threads, O_DIRECT).
- :class:`PinnedBufferPool`: a fixed-capacity aligned host buffer pool handing out uint8 tensors.
- :func:`crc32c`: the CRC32C content checksum of a tensor's bytes (SSE4.2 where the CPU has it).

Every native entry point has a pure-PyTorch fallback with the same signature (``*_torch`` /
``PythonAsyncIO``); they are used when the extension is missing and serve as test oracles.
Set ``ZINF_REQUIRE_NATIVE=1`` to make a missing or broken extension an error at import time.

[Note: adam semantics] One step matches the single-tensor path of ``torch.optim.Adam`` /
``torch.optim.AdamW`` (amsgrad=False, maximize=False) on ``grad * (clip_coef / grad_scale)``,
where the factor is computed in double and applied as a float32 multiply. Adam's weight decay is
L2 (``grad += wd * param``); AdamW's is decoupled (``param *= 1 - lr * wd``).
"""

from __future__ import annotations

import errno as _errno
import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AIOError",
    "AIOMissingPathError",
    "AIONoSpaceError",
    "AIOShortReadError",
    "AsyncIO",
    "NativeInfo",
    "PinnedBufferPool",
    "PoolExhaustedError",
    "PythonAsyncIO",
    "adam_step",
    "adam_step_torch",
    "crc32c",
    "crc32c_py",
    "checksum_backend",
    "grad_norm_sq",
    "grad_norm_sq_torch",
    "info",
    "require",
    "set_num_threads",
    "set_simd_level",
    "stream_bound",
]

_BUILD_HINT = (
    "build it with `pip install -e .` (editable) or `pip install .` from the zinf repository root "
    "(needs a C++17 compiler, CMake and pybind11; no CUDA or libtorch headers)"
)

_native: ModuleType | None
_load_error: str | None
try:
    from zinf import _native  # type: ignore[attr-defined, no-redef]

    _load_error = None
except Exception as exc:  # ImportError, or an OSError from a broken .so
    _native = None
    _load_error = f"{type(exc).__name__}: {exc}"

if _native is None and os.environ.get("ZINF_REQUIRE_NATIVE", "0") not in ("", "0"):
    raise ImportError(
        f"ZINF_REQUIRE_NATIVE is set but the zinf C++ extension zinf._native could not be loaded "
        f"({_load_error}); {_BUILD_HINT}"
    )


@dataclass(frozen=True)
class NativeInfo:
    """What the native build provides on this machine."""

    available: bool
    simd_level: str  # "avx512" | "avx2" | "scalar" | "none" (no extension)
    io_backend: str  # "io_uring" | "threads" | "python-threads" (no extension)
    num_threads: int  # OpenMP threads used by the Adam kernels
    error: str | None  # why the extension did not load


def info() -> NativeInfo:
    """Report what was built and what it will use here."""
    if _native is None:
        return NativeInfo(False, "none", "python-threads", torch.get_num_threads(), _load_error)
    io_backend = "io_uring" if _native.aio.uring_available() else "threads"
    if os.environ.get("ZINF_AIO_BACKEND") == "threads":
        io_backend = "threads"
    return NativeInfo(True, _native.adam.simd_level(), io_backend, _native.adam.num_threads(), None)


def require() -> ModuleType:
    """Return the extension module or raise ImportError saying how to build it."""
    if _native is None:
        raise ImportError(f"the zinf C++ extension zinf._native is not available ({_load_error}); {_BUILD_HINT}")
    return _native


def set_simd_level(level: str) -> None:
    """Force the Adam kernels' SIMD level: 'avx512', 'avx2' or 'scalar' (also env ZINF_SIMD)."""
    require().adam.set_simd_level(level)


def set_num_threads(num_threads: int) -> None:
    """Number of OpenMP threads the Adam kernels use (default: OMP_NUM_THREADS or all cores)."""
    require().adam.set_num_threads(num_threads)


# --------------------------------------------------------------------------- validation

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def _check(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int | None, fn: str) -> None:
    ok = (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dtype in dtypes
        and t.is_contiguous()
        and (numel is None or t.numel() == numel)
    )
    if ok:
        return
    want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
    if not isinstance(t, torch.Tensor):
        found = f"type {type(t).__name__}"
    else:
        found = (
            f"dtype={str(t.dtype).removeprefix('torch.')}, device={t.device}, "
            f"contiguous={t.is_contiguous()}, numel={t.numel()}"
        )
    size = f" with {numel} elements" if numel is not None else ""
    raise ValueError(
        f"{fn}: expected `{name}` to be a contiguous CPU {want} tensor{size}, found {found}; "
        f"pass e.g. `{name}.detach().contiguous()` of the right dtype and size"
    )


def _check_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    step: int,
) -> None:
    _check("param", param, (torch.float32,), None, "adam_step")
    n = param.numel()
    _check("grad", grad, (torch.float32, torch.bfloat16, torch.float16), n, "adam_step")
    _check("exp_avg", exp_avg, (torch.float32,), n, "adam_step")
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), n, "adam_step")
    if param_out is not None:
        _check("param_out", param_out, (torch.bfloat16, torch.float16), n, "adam_step")
    if int(step) < 1:
        raise ValueError(f"adam_step: expected step >= 1 (the step count after this update), found {step}")


# --------------------------------------------------------------------------- Adam


def adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    param_out: torch.Tensor | None = None,
) -> None:
    """Pure-PyTorch Adam/AdamW step with the semantics of :func:`adam_step` (see module note)."""
    _check_adam(param, grad, exp_avg, exp_avg_sq, param_out, step)
    with torch.no_grad():
        g = grad.to(torch.float32).mul(clip_coef / grad_scale)
        if decoupled:
            param.mul_(1.0 - lr * weight_decay)
        elif weight_decay != 0.0:
            g = g.add(param, alpha=weight_decay)
        exp_avg.lerp_(g, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if param_out is not None:
            param_out.copy_(param)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    param_out: torch.Tensor | None = None,
) -> None:
    """One fused Adam (decoupled=False) or AdamW (decoupled=True) step, in place, in one pass.

    ``step`` is the step count including this update (1 on the first call). The gradient is
    divided by ``grad_scale`` and multiplied by ``clip_coef`` on the fly; when ``param_out``
    (bf16/fp16) is given, it receives the updated parameter rounded to nearest even.
    """
    if _native is None:
        adam_step_torch(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale, clip_coef=clip_coef,
            param_out=param_out,
        )
        return
    _check_adam(param, grad, exp_avg, exp_avg_sq, param_out, step)
    _native.adam.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_NAMES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(),
        "none" if param_out is None else _DTYPE_NAMES[param_out.dtype], param.numel(),
        step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
        weight_decay=float(weight_decay), decoupled=bool(decoupled), grad_scale=float(grad_scale),
        clip_coef=float(clip_coef),
    )


def grad_norm_sq_torch(grad: torch.Tensor) -> tuple[float, bool]:
    """Pure-PyTorch :func:`grad_norm_sq` (accumulates in float64)."""
    _check("grad", grad, tuple(_DTYPE_NAMES), None, "grad_norm_sq")
    total = float(torch.sum(grad.to(torch.float64).square()))
    return total, math.isfinite(total)


def grad_norm_sq(grad: torch.Tensor) -> tuple[float, bool]:
    """Sum of squares of a fp32/bf16/fp16 gradient and whether every element is finite.

    Squares are accumulated in float64 (per SIMD lane and per thread, then summed in a fixed
    order); a float64 sum of float32 squares cannot overflow, so the sum is finite exactly when
    every element is.
    """
    if _native is None:
        return grad_norm_sq_torch(grad)
    _check("grad", grad, tuple(_DTYPE_NAMES), None, "grad_norm_sq")
    total = _native.adam.grad_norm_sq(grad.data_ptr(), _DTYPE_NAMES[grad.dtype], grad.numel())
    return total, math.isfinite(total)


def stream_bound(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Benchmark helper: move Adam's 28 bytes/param (read p, g, m, v; write p, m, v), trivial math."""
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, (torch.float32,), n, "stream_bound")
    require().adam.stream_bound(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n)


# --------------------------------------------------------------------------- async I/O


def _address(data: torch.Tensor | bytes | bytearray | memoryview) -> tuple[int, int, Any]:
    """(address, byte count, object keeping the memory alive) of a CPU tensor or a bytes-like object."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"crc32c: needs a contiguous CPU tensor, got {data.device} "
                             f"({'contiguous' if data.is_contiguous() else 'strided'})")
        return data.data_ptr(), data.numel() * data.element_size(), data
    import numpy as np  # a read-only buffer (bytes) without torch's non-writable-tensor warning

    arr = np.frombuffer(data, dtype=np.uint8)
    return arr.ctypes.data, arr.size, arr


def crc32c_py(data: torch.Tensor | bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C in pure Python: the test oracle (about 1 MB/s), and what runs without the native build."""
    if isinstance(data, torch.Tensor):
        raw = data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if data.numel() else b""
    else:
        raw = bytes(data)
    table = _CRC_TABLE
    state = crc ^ 0xFFFFFFFF
    for byte in raw:
        state = (state >> 8) ^ table[(state ^ byte) & 0xFF]
    return state ^ 0xFFFFFFFF


def _crc_table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        out.append(c)
    return out


_CRC_TABLE = _crc_table()


def crc32c(data: torch.Tensor | bytes | bytearray | memoryview, crc: int = 0) -> int:
    """The CRC32C of ``data``'s bytes (a contiguous CPU tensor of any dtype, or bytes-like), continuing from
    ``crc``: ``crc32c(b, crc32c(a)) == crc32c(a + b)``. Native (GIL released), else :func:`crc32c_py`."""
    if _native is None:
        return crc32c_py(data, crc)
    address, nbytes, _keep = _address(data)
    return int(_native.checksum.crc32c(address, nbytes, crc))


def checksum_backend() -> str:
    """What :func:`crc32c` runs on: "sse4.2", "portable" (C++ tables) or "python"."""
    return "python" if _native is None else str(_native.checksum.backend())


class AIOError(OSError):
    """A failed AsyncIO request; ``filename`` is the path, ``offset`` the file offset of the failure."""

    def __init__(self, err: int, message: str, path: str, offset: int, unlinked: bool = False) -> None:
        super().__init__(err, message, path)
        self.path = path
        self.offset = offset
        self.unlinked = unlinked  # a failed write removed its (undefined) target file

    def __str__(self) -> str:
        removed = "; the partially written file was removed" if self.unlinked else ""
        return (
            f"[Errno {self.errno}] {self.strerror} (path={self.path!r}, offset={self.offset}{removed})"
        )


class AIOMissingPathError(AIOError, FileNotFoundError):
    """The file (read) or its directory (write) does not exist (ENOENT)."""


class AIONoSpaceError(AIOError):
    """The file system is full (ENOSPC)."""


class AIOShortReadError(AIOError):
    """A read reached the end of the file before the requested bytes (errno EIO)."""


def _make_aio_error(err: int, short_read: bool, message: str, path: str, offset: int, unlinked: bool) -> AIOError:
    if short_read:
        return AIOShortReadError(_errno.EIO, message, path, offset, unlinked)
    if err == _errno.ENOENT:
        return AIOMissingPathError(err, message, path, offset, unlinked)
    if err == _errno.ENOSPC:
        return AIONoSpaceError(err, message, path, offset, unlinked)
    return AIOError(err, message, path, offset, unlinked)


def _check_io_tensor(t: torch.Tensor, fn: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        found = type(t).__name__ if not isinstance(t, torch.Tensor) else f"device={t.device}, contiguous={t.is_contiguous()}"
        raise ValueError(f"AsyncIO.{fn}: expected a contiguous CPU tensor, found {found}")


class _AsyncIOBase:
    def __enter__(self) -> _AsyncIOBase:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class AsyncIO(_AsyncIOBase):
    """Asynchronous reads/writes of whole tensors to files at byte offsets.

    Requests are split into ``block_size`` pieces with up to ``queue_depth`` in flight (io_uring)
    or ``num_threads`` pread/pwrite threads. With ``direct=True`` the 4096-aligned body of a request
    whose buffer address and offset are 4096-aligned uses O_DIRECT; file systems without O_DIRECT
    (tmpfs) fall back to buffered I/O, reported by ``.direct`` and logged once.
    A failed write unlinks its target file. The tensor must stay alive and untouched until waited;
    this object keeps a reference to it until then.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, num_threads: int = 2, direct: bool = True,
                 backend: str = "auto") -> None:
        if _native is None:
            raise ImportError(f"AsyncIO needs the zinf C++ extension; use PythonAsyncIO instead, or {_BUILD_HINT}")
        self._engine = _native.aio.Engine(block_size, queue_depth, num_threads, direct, backend)
        self._direct_requested = direct
        self._tensors: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._warned_fallback = False

    @property
    def backend(self) -> str:
        return str(self._engine.backend)

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT was in effect for the last submitted request."""
        return bool(self._engine.last_direct)

    def _submit(self, write: bool, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int) -> int:
        _check_io_tensor(tensor, "submit_write" if write else "submit_read")
        path = os.fspath(path)
        nbytes = tensor.numel() * tensor.element_size()
        handle = int(self._engine.submit(write, tensor.data_ptr(), nbytes, path, int(offset)))
        with self._lock:
            self._tensors[handle] = tensor
        if self._direct_requested and not self._engine.last_direct and not self._warned_fallback and nbytes >= 4096 \
                and tensor.data_ptr() % 4096 == 0 and offset % 4096 == 0:
            self._warned_fallback = True
            logger.info("zinf::aio O_DIRECT not supported for %r (EINVAL at open); using buffered I/O", path)
        return handle

    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        return self._submit(True, tensor, path, offset)

    def submit_read(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        return self._submit(False, tensor, path, offset)

    def done(self, handle: int) -> bool:
        """Whether the request has finished; never blocks (``wait`` still gives its result)."""
        return bool(self._engine.done(handle))

    def wait(self, handle: int) -> int:
        """Block until the request is done; return its byte count or raise an AIOError."""
        res = self._engine.wait(handle)
        with self._lock:
            self._tensors.pop(handle, None)
        if res.err:
            raise _make_aio_error(res.err, res.short_read, res.message, res.path, res.err_offset, res.unlinked)
        return int(res.nbytes)

    def wait_all(self) -> None:
        """Wait for every outstanding request; raise the first failure (others are logged)."""
        failures = self._engine.wait_all()
        with self._lock:
            self._tensors.clear()
        errors = [_make_aio_error(r.err, r.short_read, r.message, r.path, r.err_offset, r.unlinked) for _, r in failures]
        for e in errors[1:]:
            logger.error("zinf::aio request failed: %s", e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._engine.close()
        with self._lock:
            self._tensors.clear()


class PythonAsyncIO(_AsyncIOBase):
    """Pure-Python AsyncIO (os.pread/os.pwrite on a thread pool; buffered I/O, never O_DIRECT)."""

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, num_threads: int = 2, direct: bool = True) -> None:
        self._block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="zinf-aio")
        self._futures: dict[int, tuple[Future[int], torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._next = 1

    backend = "python-threads"
    direct = False

    @staticmethod
    def _run(write: bool, tensor: torch.Tensor, path: str, offset: int, block_size: int) -> int:
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        nbytes = len(view)
        try:
            fd = os.open(path, (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY, 0o644)
        except OSError as e:
            raise _make_aio_error(e.errno or 0, False, f"cannot open {path!r}: {e.strerror}", path, offset, False) from e
        failed = True
        done = 0
        try:
            while done < nbytes:
                chunk = view[done : min(nbytes, done + block_size)]
                try:
                    n = os.pwrite(fd, chunk, offset + done) if write else os.preadv(fd, [chunk], offset + done)
                except OSError as e:
                    raise _make_aio_error(e.errno or 0, False, f"{'write' if write else 'read'} failed: {e.strerror}",
                                          path, offset + done, write) from e
                if n == 0:
                    raise _make_aio_error(_errno.EIO, not write, "short read: reached end of file", path,
                                          offset + done, write)
                done += n
            failed = False
        finally:
            os.close(fd)
            if failed and write:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return nbytes

    def _submit(self, write: bool, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int) -> int:
        _check_io_tensor(tensor, "submit_write" if write else "submit_read")
        fut = self._pool.submit(self._run, write, tensor, os.fspath(path), int(offset), self._block_size)
        with self._lock:
            handle = self._next
            self._next += 1
            self._futures[handle] = (fut, tensor)
        return handle

    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        return self._submit(True, tensor, path, offset)

    def submit_read(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        return self._submit(False, tensor, path, offset)

    def done(self, handle: int) -> bool:
        with self._lock:
            if handle not in self._futures:
                raise ValueError(f"unknown or already waited AsyncIO handle {handle}")
            return self._futures[handle][0].done()

    def wait(self, handle: int) -> int:
        with self._lock:
            if handle not in self._futures:
                raise ValueError(f"unknown or already waited AsyncIO handle {handle}")
            fut, _ = self._futures.pop(handle)
        return fut.result()

    def wait_all(self) -> None:
        with self._lock:
            handles = list(self._futures)
        errors: list[BaseException] = []
        for h in handles:
            try:
                self.wait(h)
            except ValueError:
                continue
            except AIOError as e:
                errors.append(e)
        for e in errors[1:]:
            logger.error("zinf::aio request failed: %s", e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._pool.shutdown(wait=True)


if _native is None:
    AsyncIO = PythonAsyncIO  # type: ignore[assignment, misc]  # noqa: F811


# --------------------------------------------------------------------------- buffer pool


class PoolExhaustedError(MemoryError):
    """No free block of the requested size is left in a PinnedBufferPool."""


class PinnedBufferPool:
    """A fixed-capacity, aligned host buffer pool (buddy allocator inside one allocation).

    ``acquire(nbytes)`` returns a uint8 tensor view of exactly ``nbytes`` whose data pointer is
    aligned to ``min(alignment * 2^k, ...)`` >= ``alignment``; ``.view(dtype)`` it as needed.
    Blocks are rounded up to ``alignment * 2^k`` bytes; ``bytes_in_use`` counts those blocks.
    Memory is page-locked for CUDA only by :meth:`pin_with_cuda` (cudaHostRegister), when CUDA exists.
    """

    def __init__(self, total_bytes: int, alignment: int = 4096) -> None:
        native = require()
        self._pool = native.pool.BufferPool(int(total_bytes), int(alignment))
        self._arena = torch.frombuffer(memoryview(self._pool), dtype=torch.uint8)
        self._base = int(self._pool.address)
        self._pinned = False

    @property
    def capacity_bytes(self) -> int:
        return int(self._pool.capacity_bytes)

    @property
    def bytes_in_use(self) -> int:
        return int(self._pool.bytes_in_use)

    @property
    def peak_bytes_in_use(self) -> int:
        return int(self._pool.peak_bytes_in_use)

    @property
    def requested_bytes_in_use(self) -> int:
        return int(self._pool.requested_bytes_in_use)

    @property
    def largest_free_block_bytes(self) -> int:
        return int(self._pool.largest_free_block)

    @property
    def alignment(self) -> int:
        return int(self._pool.alignment)

    def acquire(self, nbytes: int) -> torch.Tensor:
        if nbytes < 0:
            raise ValueError(f"PinnedBufferPool.acquire: expected nbytes >= 0, found {nbytes}")
        offset = self._pool.allocate(int(nbytes))
        if offset is None:
            raise PoolExhaustedError(
                f"PinnedBufferPool exhausted: requested {nbytes} bytes (a block of "
                f"{self._pool.block_size_for(int(nbytes))} bytes), {self.bytes_in_use} of {self.capacity_bytes} "
                f"bytes in use, largest free block {self.largest_free_block_bytes} bytes; release buffers "
                f"or create the pool with a larger total_bytes (for the engine's NVMe staging pool: raise "
                f"offload.pinned_pool_bytes if host memory allows, else lower offload.sub_group_numel)"
            )
        return self._arena[offset : offset + nbytes]

    def release(self, tensor: torch.Tensor) -> None:
        offset = tensor.data_ptr() - self._base
        if not 0 <= offset < self.capacity_bytes:
            raise ValueError("PinnedBufferPool.release: the tensor does not point into this pool")
        self._pool.free(offset)

    def pin_with_cuda(self) -> bool:
        """Page-lock the whole arena for CUDA (cudaHostRegister). Returns False without CUDA.

        Not exercised on a GPU yet (developed on a CPU-only machine).
        """
        if self._pinned:
            return True
        if not torch.cuda.is_available():
            return False
        cudart: Any = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._base, self.capacity_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.capacity_bytes} bytes failed with error {err}: the system "
                               "would not page-lock that much host memory; lower offload.pinned_pool_bytes (the size of "
                               "this pool) or raise the locked-memory limit (ulimit -l)")
        self._pinned = True
        return True

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base)
            self._pinned = False
