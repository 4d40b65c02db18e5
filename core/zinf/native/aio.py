"""Asynchronous file I/O of whole tensors: wraps ``zinf._native.aio`` (stub: ``_native_aio.pyi`` beside this file).

- :class:`AsyncIO`: reads/writes at byte offsets through io_uring or a pread/pwrite thread pool, with
  O_DIRECT for aligned requests (native; without the extension ``AsyncIO`` is :class:`PythonAsyncIO`).
- :class:`PythonAsyncIO`: the pure-Python equivalent (os.pread/os.pwrite on threads, buffered I/O).
- :class:`AIOError` and its subclasses :class:`AIOMissingPathError` (ENOENT), :class:`AIONoSpaceError`
  (ENOSPC) and :class:`AIOShortReadError` (end of file before the requested bytes): every failure of
  both implementations is one of them, with the path and file offset.

[Note: aio failed writes] A write that fails unlinks its target file where that write created it (its contents are
undefined, so no new file that looks valid is left); a file that existed before is left as it was: it holds other
records (a swap file, whose other records are still live). ``AIOError.unlinked`` says which.
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import torch

from .loader import _BUILD_HINT, _native

logger = logging.getLogger(__name__)

__all__ = [
    "AIOError",
    "AIOMissingPathError",
    "AIONoSpaceError",
    "AIOShortReadError",
    "AsyncIO",
    "PythonAsyncIO",
]


class AIOError(OSError):
    """A failed AsyncIO request; ``filename`` is the path, ``offset`` the file offset of the failure."""

    def __init__(self, err: int, message: str, path: str, offset: int, unlinked: bool = False) -> None:
        super().__init__(err, message, path)
        self.path = path
        self.offset = offset
        self.unlinked = unlinked  # a failed write removed the (undefined) target file it created

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
    A failed write unlinks its target file if it created it (see [Note: aio failed writes]). The tensor must stay
    alive and untouched until waited; this object keeps a reference to it until then. ``bytes_per_s`` > 0 caps the
    bytes moved per second, reads and writes together: each block completes no sooner than its bytes fit under the
    rate.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, num_threads: int = 2, direct: bool = True,
                 backend: str = "auto", bytes_per_s: float = 0.0) -> None:
        if _native is None:
            raise ImportError(f"AsyncIO needs the zinf C++ extension; use PythonAsyncIO instead, or {_BUILD_HINT}")
        if bytes_per_s != 0 and not bytes_per_s >= 1:
            raise ValueError(f"AsyncIO: bytes_per_s = {bytes_per_s!r}; expected 0 (no cap) or at least 1 byte a second")
        self._engine = _native.aio.Engine(block_size, queue_depth, num_threads, direct, backend, float(bytes_per_s))
        self._direct_requested = direct
        self._tensors: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._warned_fallback = False

    @property
    def backend(self) -> str:
        return str(self._engine.backend)

    @property
    def bytes_per_s(self) -> float:
        """The cap on bytes moved per second (0: none)."""
        return float(self._engine.bytes_per_s)

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
        created = False  # only a file this write created is removed when it fails (see [Note: aio failed writes])
        try:
            if write:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    created = True
                except FileExistsError:
                    fd = os.open(path, os.O_WRONLY)
            else:
                fd = os.open(path, os.O_RDONLY)
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
                                          path, offset + done, created) from e
                if n == 0:
                    raise _make_aio_error(_errno.EIO, not write, "short read: reached end of file", path,
                                          offset + done, created)
                done += n
            failed = False
        finally:
            os.close(fd)
            if failed and created:
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
