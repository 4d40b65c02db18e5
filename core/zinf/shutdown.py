"""How a process that ran zinf ends: orderly when the script ends, with one line naming the rank and phase when it
does not.

[Note: the end of a run]
A two-rank gloo run whose work was done could still be reported failed: a rank killed by SIGABRT at exit ("terminate
called without an active exception"), no traceback. Core dumps of it (torch 2.13; a bare all-reduce script and a zinf
run) show where: a worker thread of ``ProcessGroupGloo`` (``runLoop``) drops its last reference to a finished
collective (``~AsyncWork``); what the work holds has Python objects (its tensors, or the thread-local state it
captured, a ``SafePyObject``), so the release takes the GIL; the main thread has begun ``Py_FinalizeEx`` meanwhile, so
taking the GIL ends the thread with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls
``std::terminate``. No thread of zinf's is involved. It happens whenever a gloo group is still alive when the
interpreter finalizes, within a few milliseconds of that group's last collective: without
``dist.destroy_process_group()`` (13 of 20 bare two-rank runs of 300 all-reduces here; 2 of 10 runs of a zinf script
ending on an all-reduce), and also with it when anything still refers to the group (a script's own variable, a DDP
model's reducer: 11 of 16), since destroying only drops torch's own references. Upstream: pytorch/pytorch#190489
(open), #179291 and #157193 (an exit handler in torch, not merged).

So the first engine registers an exit handler (``_Process._at_exit``). Exit handlers run last-registered first,
before the interpreter finalizes, with every thread still able to take the GIL; this one runs before those registered
earlier (the launchers', torch's) and after zinf's later ones (the background CPU-Adam's join). It closes every engine
the script did not close (background steps and I/O threads joined, the same-host shared memory unmapped; without any
collective when an uncaught exception or a SIGTERM is ending the process, as the other ranks may be anywhere),
destroys the default process group and every group made from it if the script has not (Lightning does the same at
exit for NCCL), then collects cyclic garbage that still holds a group, so that each group's destructor joins its worker
threads now, and finally yields the GIL for a moment so that a worker finishing a release gets it. A group the script
itself still refers to outlives all this (so does the gloo control group of an engine on NCCL that the script still
holds: its ``Comm`` keeps it); that moment is what is left for it.

Whatever ends a run early leaves one line naming the rank and the phase: a fatal signal through the C++ handler of
zinf/native/fault.py ([Note: the fault line]), an uncaught exception through ``_Process._excepthook``, which names
the phase the exception left (recorded by :func:`phase` as it unwinds).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import sys
import threading
import time
import weakref
from types import TracebackType
from typing import Callable, Iterator, Protocol

import torch.distributed as dist

from zinf.native import fault
from zinf.offload import cleanup

__all__ = ["install", "phase", "track", "release_process_groups"]

log = logging.getLogger(__name__)

_GIL_GRACE_S = 0.02  # long enough for a runnable worker thread to take the GIL and release a finished collective
_OUTSIDE = "the script's own code (outside zinf's calls)"


class Closeable(Protocol):
    def close(self, wait_for_ranks: bool = True) -> None: ...


class _Process:
    """This process's end: the engines to close at exit, its rank for the lines, how it is ending."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: "weakref.WeakSet[Closeable]" = weakref.WeakSet()
        self._rank, self._world = -1, 0
        self._exit_handler = False
        self._previous_excepthook: Callable[..., object] | None = None
        self._uncaught = False  # an exception nobody caught is ending the process
        # the innermost phase an exception left, recorded as it unwinds: (its id and type, the phase); not the
        # exception itself, whose traceback would keep every frame it passed (and their tensors) alive
        self._raised_in: tuple[tuple[int, type], str] | None = None

    def install(self, rank: int, world: int) -> None:
        """This process's fault line and uncaught-exception line, naming ``rank`` of ``world`` (idempotent)."""
        with self._lock:
            self._rank, self._world = rank, world
            fault.install(rank, world)
            if self._previous_excepthook is None:
                self._previous_excepthook = sys.excepthook
                sys.excepthook = self._excepthook

    def track(self, engine: Closeable) -> None:
        """Close ``engine`` at exit if the script does not (see [Note: the end of a run])."""
        with self._lock:
            self._engines.add(engine)
            if not self._exit_handler:
                self._exit_handler = True
                atexit.register(self._at_exit)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with phase("forward"): ...``: a fault line or an uncaught exception from inside names ``name``; the
        enclosing phase again after."""
        outer = fault.current_phase()
        fault.set_phase(name)
        try:
            yield
        except BaseException as exc:
            key = (id(exc), type(exc))
            if self._raised_in is None or self._raised_in[0] != key:  # the innermost phase wins
                self._raised_in = (key, name)
            raise
        finally:
            fault.set_phase(outer)

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        """The traceback as before, then one line: which rank ended, in which phase, by what."""
        self._uncaught = True
        if self._previous_excepthook is not None:
            self._previous_excepthook(kind, exc, tb)
        raised_in = self._raised_in
        where = raised_in[1] if raised_in is not None and raised_in[0] == (id(exc), kind) else fault.current_phase()
        rank = f"{self._rank} of {self._world}" if self._rank >= 0 else "?"
        lines = str(exc).strip().splitlines()
        cause = f": {lines[0][:200]}" if lines else ""
        sys.stderr.write(f"zinf: rank {rank} ended by an uncaught {kind.__name__} during {where or _OUTSIDE}{cause}\n")
        sys.stderr.flush()

    def _at_exit(self) -> None:
        fault.set_phase("zinf's exit handler: closing engines")
        for engine in list(self._engines):  # closing twice does nothing: closed ones need no check here
            try:
                engine.close(wait_for_ranks=not (self._uncaught or cleanup.stopping()))
            except Exception as exc:  # noqa: BLE001 - the process is ending: said, not raised
                log.warning("zinf: closing an engine at exit failed: %s: %s", type(exc).__name__, exc)
        fault.set_phase("zinf's exit handler: releasing the process groups")
        try:
            release_process_groups()
        except Exception as exc:  # noqa: BLE001
            log.warning("zinf: destroying the process group at exit failed: %s: %s", type(exc).__name__, exc)
        fault.set_phase("interpreter exit")


def release_process_groups() -> None:
    """Destroy the default process group and every group made from it, if the script has not, and free what still
    holds one, while the interpreter is whole (see [Note: the end of a run])."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    time.sleep(_GIL_GRACE_S)


_PROCESS = _Process()
install = _PROCESS.install
track = _PROCESS.track
phase = _PROCESS.phase
