"""One pinned pool, one room-maker: who gives pool room back when somebody is short of it.

Every user of the pinned staging pool (the NVMe parameter store, the optimizer-state pipeline, the gradient
stash) is built with the same ``PoolRoom``; each registers, in its constructor, what it can give back without
losing anything (trailing writes to finish, read-ahead to drop, idle cached shards) with its place in the
one eviction order: the optimizer's pipeline first (``OPTIMIZER``), then the parameter store's idle slots
(``PARAMS``), then the gradients held for the step (``HELD_GRADS``). A buffer for work that must not fail for room is taken with ``acquire_waiting``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from zinf.native import PinnedBufferPool, PoolExhaustedError

__all__ = ["PoolRoom", "ACQUIRE_TIMEOUT_S", "block_bytes", "OPTIMIZER", "PARAMS", "HELD_GRADS"]

ACQUIRE_TIMEOUT_S = 120.0
# eviction order: what the optimizer holds without need goes first; gradients held for the step last (each costs a
# write, then a read)
OPTIMIZER, PARAMS, HELD_GRADS = 0, 1, 2


def block_bytes(nbytes: int) -> int:
    """The pool's (buddy) block size for a request of ``nbytes``."""
    return 1 << max(12, (nbytes - 1).bit_length())


class PoolRoom:
    def __init__(self, pool: PinnedBufferPool) -> None:
        self.pool = pool
        self._evictors: list[tuple[int, Callable[[], bool]]] = []
        self._listeners: list[Callable[[], None]] = []

    def add_evictor(self, order: int, free_one: Callable[[], bool]) -> None:
        """``free_one`` gives back one piece of room it holds without need; False when it holds none. Lower
        ``order`` is asked first."""
        self._evictors.append((order, free_one))
        self._evictors.sort(key=lambda e: e[0])

    def add_listener(self, on_room: Callable[[], None]) -> None:
        """``on_room`` is told when a gather gave room back outside a training forward (state read-ahead)."""
        self._listeners.append(on_room)

    @property
    def free_bytes(self) -> int:
        return self.pool.capacity_bytes - self.pool.bytes_in_use

    def make_room(self) -> bool:
        """Free one piece of the pool that is not needed right now; False when nothing could be freed."""
        return any(free_one() for _, free_one in self._evictors)

    def room_given_back(self) -> None:
        for on_room in self._listeners:
            on_room()

    def acquire_waiting(self, nbytes: int) -> torch.Tensor:
        """A pool buffer for work that must not fail for room (the optimizer pipeline, an updated shard).
        The pool keeps a reserve for it, but buddy fragmentation can still leave no block of the size: then
        room is made (read-ahead given up, trailing writes finished), or buffers held by gathers in flight
        are waited for, for at most ``ACQUIRE_TIMEOUT_S``. Never call it holding a lock those gathers need."""
        deadline = time.monotonic() + ACQUIRE_TIMEOUT_S
        while True:
            try:
                return self.pool.acquire(nbytes)
            except PoolExhaustedError:
                if time.monotonic() > deadline:
                    raise
                if not self.make_room():
                    time.sleep(0.002)
