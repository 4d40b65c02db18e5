"""The line a process killed by a fatal signal leaves: wraps ``zinf._native.fault`` (stub: ``_native_fault.pyi``).

[Note: the fault line] A rank that dies by SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL prints no Python traceback:
the signal kills it between two bytecodes or in a thread Python does not run (a C++ ``std::terminate`` in a
collective's worker thread, a bad access in a kernel), and the launcher only says "Signal 6 (SIGABRT) received". So
the engine installs, once per process, a handler in C++ that writes one line to stderr naming the rank, the thread
(the main one, or a worker by its id and name) and the phase of the run (set by zinf/shutdown.py's ``phase``
blocks: ``forward``, ``the optimizer step``, ``closing the engine``, ``interpreter exit`` ...), then hands the signal
on to what handled it before (Python's ``faulthandler`` if enabled, which adds every thread's traceback; else the
default action, so the exit status still says which signal). It does nothing else: the process still dies as it would have.

Without the extension, Python's ``faulthandler`` is enabled instead: its dump names the signal and the threads'
Python frames, but not the rank or the phase.
"""

from __future__ import annotations

import faulthandler
import sys

from .loader import _native

__all__ = ["install", "installed", "set_phase", "current_phase", "describe"]

_py_phase = ""  # the phase without the extension (nothing reads it in a signal handler then)


def install(rank: int, world: int) -> bool:
    """Install the fault line's handlers for this process (idempotent; a later call updates the rank). Returns
    whether the native handler is in place; without it Python's faulthandler is enabled instead."""
    if _native is not None:
        _native.fault.install(int(rank), int(world))
        return True
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.__stderr__ or sys.stderr)
    return False


def installed() -> bool:
    return _native is not None and bool(_native.fault.installed())


def set_phase(name: str) -> None:
    """The phase a fault line names from now on ("" is the script's own code, outside zinf's calls)."""
    global _py_phase
    if _native is not None:
        _native.fault.set_phase(name)
    else:
        _py_phase = name


def current_phase() -> str:
    return _native.fault.phase() if _native is not None else _py_phase


def describe(signum: int) -> str:
    """The line the handler would write for ``signum`` in this thread now (for the tests; needs the extension)."""
    assert _native is not None, "zinf.native.fault.describe needs the C++ extension"
    return str(_native.fault.describe(int(signum)))
