"""Swap files never outlive their run: removed at exit, on SIGTERM and Ctrl-C, and found again when the
process that owned them died before it could remove them.

[Note: clean stops]
Swap files are scratch (tens of GB), never checkpoints. Every open swap file is registered here. At
interpreter exit (a normal end, an exception, Ctrl-C) one exit handler removes the registered files with
SIGINT and SIGTERM ignored, so a second Ctrl-C cannot cut the removal short. SIGTERM (how schedulers stop
jobs) ends the process without exit handlers by default, so when the process has no SIGTERM handler of
its own, zinf installs one that raises ``SystemExit(143)`` in the main thread: the training loop unwinds
as for an exception, in-flight I/O is waited for or abandoned by its owners, and the exit handler removes
the files. A handler the program installed itself (to checkpoint and carry on) is left alone.

``zinf.Init``'s construction spill files (zinf/offload/spill_store.py) are scratch of the same kind, with the
owner's host and pid in their name instead of a header: they are locked, registered and collected alike.

SIGKILL and power loss leave files behind. The owner holds a shared ``flock`` on each of its files for as
long as it runs (the kernel drops it when the process dies, however it dies), and the header records its
host and pid for the messages. A later run on the same paths removes every zinf swap file on which it can
take an exclusive lock (no live process holds it), logging what it freed; files of runs still alive are
left alone and named when the drive is too full. A SIGTERM that arrives while the main thread waits inside
a collective or an I/O wait is handled when that wait returns; if the scheduler's SIGKILL comes first, the
next run removes the files.

Where the ``SystemExit`` is raised matters: raised between two bytecodes of the engine's own work (a pool
slot handed back half way, a gather finished but not yet recorded), the unwinding code met the engine in a
state no verb leaves it in and failed with an assertion instead of exiting with 143 (seen in 1 of 56
SIGTERMs of a small NVMe run). So the engine's entry points (forward, backward, step) run inside
:func:`stops_deferred`: a SIGTERM that arrives inside one is noted and raised when the outermost one returns,
at a point where every object is in one of its states. Outside them (the user's data loading, logging) it is
raised at once, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["register", "unregister", "owner", "lock", "hold", "Leftover", "collect_leftovers", "remove_registered",
           "stops_deferred", "stopping"]

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_FILES: set[str] = set()
_INSTALLED = False
PATTERN = "zinf-r*-of-*-*.swap"
SPILL_PATTERN = "zinf-init-*.spill"
_SPILL_NAME = re.compile(r"zinf-init-(?P<host>.+)-(?P<pid>\d+)-r\d+\.spill")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def owner() -> dict[str, object]:
    """What a swap file's header records about the process writing it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def register(files: list[str]) -> None:
    global _INSTALLED
    with _LOCK:
        _FILES.update(files)
        if _INSTALLED:
            return
        _INSTALLED = True
    atexit.register(remove_registered)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def unregister(files: list[str]) -> None:
    with _LOCK:
        _FILES.difference_update(files)


_DEFERRING = 0  # depth of stops_deferred() on the main thread
_PENDING_SIGNAL: int | None = None  # a SIGTERM noted inside it
_STOPPING = False  # a SIGTERM was received: the process is being stopped


def stopping() -> bool:
    """Whether a SIGTERM is stopping this process (the other ranks may be anywhere: see zinf/shutdown.py)."""
    return _STOPPING


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Engine work during which a SIGTERM is noted, not raised; it is raised when the outermost block ends
    (see [Note: clean stops]). Other threads run the block plainly: signal handlers run on the main thread."""
    global _DEFERRING, _PENDING_SIGNAL
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    entered = False
    try:
        _DEFERRING += 1
        entered = True
        yield
    finally:
        if entered:
            _DEFERRING -= 1
        if _DEFERRING == 0 and _PENDING_SIGNAL is not None:
            # raised here even when the block raised: the stop is not lost, and the exit status stays 143
            signum, _PENDING_SIGNAL = _PENDING_SIGNAL, None
            raise SystemExit(128 + signum)


def _on_sigterm(signum: int, frame: object) -> None:
    global _PENDING_SIGNAL, _STOPPING
    _STOPPING = True
    log.warning("zinf: SIGTERM received; stopping and removing the swap files")
    if _DEFERRING:
        _PENDING_SIGNAL = signum  # raised when the engine's current call returns
        return
    raise SystemExit(128 + signum)


def remove_registered() -> None:
    """Remove every registered swap file, with SIGINT/SIGTERM ignored meanwhile (main thread only)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {}
    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        with _LOCK:
            files = sorted(_FILES)
            _FILES.clear()
        for f in files:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
            except OSError as exc:  # a file we cannot remove is reported, not hidden
                log.warning("zinf: could not remove swap file %s: %s", f, exc)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@dataclass
class Leftover:
    path: str
    nbytes: int
    alive: bool  # its process still runs (or it cannot be told: another host, an unreadable header)
    why: str


def lock(fd: int) -> None:
    """Take the shared lock that marks an open swap file as in use by this process (held until ``fd`` closes)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def hold(path: str) -> int:
    """Open ``path`` and :func:`lock` it; returns the fd to close."""
    fd = os.open(path, os.O_RDONLY)
    lock(fd)
    return fd


def _held(f: object) -> bool:
    """Whether a live process holds its lock on the open file ``f`` (an exclusive lock cannot be taken)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
    except BlockingIOError:
        return True
    fcntl.flock(f.fileno(), fcntl.LOCK_UN)  # type: ignore[attr-defined]
    return False


def _inspect(path: Path) -> Leftover:
    nbytes = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(4096).rstrip(b"\0") or b"{}")
            if not isinstance(header, dict) or header.get("magic") != "ZINFSWAP":
                return Leftover(str(path), nbytes, True, "not a zinf swap file (its header differs)")
            who = f"pid {header.get('pid', '?')} on host {header.get('host', '?')}"
            if _held(f):
                return Leftover(str(path), nbytes, True, f"in use by a live run ({who})")
    except (OSError, ValueError):
        return Leftover(str(path), nbytes, True, "its header is unreadable")
    return Leftover(str(path), nbytes, False, f"left by {who}, which is gone")


def _inspect_spill(path: Path) -> Leftover:
    """A construction spill file: alive while its owner holds its lock, or while a process of its pid runs on
    this host (the owner creates the file a moment before it locks it)."""
    nbytes = path.stat().st_size
    named = _SPILL_NAME.fullmatch(path.name)
    if named is None:
        return Leftover(str(path), nbytes, True, "not named as a zinf spill file")
    host, pid = named["host"], int(named["pid"])
    who = f"pid {pid} on host {host}"
    if host == socket.gethostname() and _start_time(pid) is not None:
        return Leftover(str(path), nbytes, True, f"in use by a live run ({who})")
    try:
        with open(path, "rb") as f:
            if _held(f):
                return Leftover(str(path), nbytes, True, f"in use by a live run ({who})")
    except OSError:
        return Leftover(str(path), nbytes, True, "it cannot be opened")
    return Leftover(str(path), nbytes, False, f"left by {who}, which is gone")


def collect_leftovers(dirs: list[str]) -> list[Leftover]:
    """Remove swap and spill files in ``dirs`` whose process is gone (logged); return the ones still owned by a
    live run."""
    kept: list[Leftover] = []
    with _LOCK:
        ours = set(_FILES)
    for d in dirs:
        found = [(p, _inspect) for p in sorted(Path(d).glob(PATTERN))]
        found += [(p, _inspect_spill) for p in sorted(Path(d).glob(SPILL_PATTERN))]
        for path, inspect in found:
            if str(path) in ours:
                continue
            try:
                item = inspect(path)
            except FileNotFoundError:
                continue
            if item.alive:
                kept.append(item)
                continue
            try:
                path.unlink(missing_ok=True)  # another rank on the same paths may have removed it first
                log.warning("zinf offload: removed %s (%.1f MiB), %s", path, item.nbytes / 2**20, item.why)
            except OSError as exc:
                kept.append(Leftover(item.path, item.nbytes, True, f"{item.why}, but removing it failed: {exc}"))
    return kept
