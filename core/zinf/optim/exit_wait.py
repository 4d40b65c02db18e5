"""Interpreter exit waits for every background step of the offloaded CPU-Adam that is still running.

[Note: a background step at exit]
The step runs on a worker of a one-thread ``ThreadPoolExecutor`` (made at the first background step, kept until
the engine closes), which interpreter exit joins after its queued work is done, instead of killing it inside
native code. That join only knows a worker once it started, a moment after the first submission: an exception
raised in the main thread in between leaves a step running that nobody waits for. zinf's SIGTERM handler raised
its ``SystemExit`` there (now it waits for ``step()`` to return: [Note: clean stops] in zinf/offload/cleanup.py);
a Ctrl-C still can. Finalization then stops the thread when it next takes the GIL, inside the C++ Adam's or the
I/O wait's frames, and the process aborts ("terminate called without an active exception", seen about once in ten
SIGTERMs of a small NVMe run) before the swap files are removed. So an exit handler joins every background step
once its thread is running (:func:`_join_background_steps`); registered when the first step starts, it runs before
the swap files' removal (exit handlers run last-registered first).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol

__all__ = ["wait_at_exit"]


class _Joinable(Protocol):
    def join_at_exit(self) -> None: ...


_RUNNING: "weakref.WeakSet[_Joinable]" = weakref.WeakSet()  # optimizers that started a background step
_EXIT_HANDLER = threading.Lock()
_exit_handler_registered = False


def _join_background_steps() -> None:
    """At interpreter exit: wait for every background step (see [Note: a background step at exit])."""
    for optimizer in list(_RUNNING):
        optimizer.join_at_exit()


def _register_exit_handler() -> None:
    global _exit_handler_registered
    with _EXIT_HANDLER:
        if not _exit_handler_registered:
            atexit.register(_join_background_steps)
            _exit_handler_registered = True


def wait_at_exit(optimizer: _Joinable) -> None:
    """Make interpreter exit call ``optimizer.join_at_exit()`` (see [Note: a background step at exit])."""
    _register_exit_handler()
    _RUNNING.add(optimizer)
