"""An aligned host buffer pool: wraps ``zinf._native.pool`` (stub: ``_native_pool.pyi`` beside this file).

:class:`PinnedBufferPool` hands out uint8 tensor views of one fixed allocation (a buddy allocator in
C++); it needs the extension (there is no pure-Python pool). :class:`PoolExhaustedError` is raised
when no free block of the requested size is left.
"""

from __future__ import annotations

from typing import Any

import torch

from .loader import require

__all__ = ["PinnedBufferPool", "PoolExhaustedError"]


class PoolExhaustedError(MemoryError):
    """No free block of the requested size is left in a PinnedBufferPool."""


class PinnedBufferPool:
    """A fixed-capacity, aligned host buffer pool (buddy allocator inside one allocation).

    ``acquire(nbytes)`` returns a uint8 tensor view of exactly ``nbytes`` whose data pointer is
    aligned to ``min(alignment * 2^k, ...)`` >= ``alignment``; ``.view(dtype)`` it as needed.
    Blocks are rounded up to ``alignment * 2^k`` bytes; ``bytes_in_use`` counts those blocks.
    Memory is page-locked for CUDA only by :meth:`pin_with_cuda` (cudaHostRegister), when CUDA exists.
    """

    def __init__(self, total_bytes: int, alignment: int = 4096, memory: Any = None) -> None:
        """``memory``: a writable buffer of at least ``total_bytes`` (an ``mmap`` of a segment other processes map
        too: zinf/runtime/shared_pool.py) that the pool carves instead of allocating; it is kept alive with the pool."""
        native = require()
        if memory is None:
            self._pool = native.pool.BufferPool(int(total_bytes), int(alignment))
        else:
            address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
            self._pool = native.pool.BufferPool(address, min(int(total_bytes), len(memory)), int(alignment))
        self._memory = memory
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
