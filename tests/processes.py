"""Child processes of the test suite never outlive it.

[Note: reaping] A test's launcher (torchrun, accelerate launch, a Lightning driver) runs in a process group of
its own, and run_distributed's workers are remembered by pid. Whatever ends the wait for them (the process
exiting, a timeout, a failed assertion, Ctrl-C, pytest-timeout) kills what is left with SIGKILL, which also
ends a stopped process (state T) that would never act on SIGTERM or SIGINT, and reaps it. The pytest session's end
(conftest.py) kills anything still registered, so an interrupted run leaves no worker behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Iterable, Sequence

__all__ = ["run", "kill_pids", "kill_leftovers", "default_sigint", "env_without_launch"]

_GROUPS: set[int] = set()  # process groups of running launchers (their leader's pid)
_PIDS: set[int] = set()  # spawned workers of run_distributed


_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def env_without_launch() -> dict[str, str]:
    """This process's environment without a launcher's rendezvous variables, for a child that starts its own
    ranks: another run's rendezvous must not leak in."""
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH}


def default_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: a process started in the background by a
    non-interactive shell (a CI runner, ``cmd &``) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt; the child gets the default disposition back, as a terminal's foreground process has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_pids(pids: Iterable[int]) -> None:
    """SIGKILL each process that is still there (stopped ones included)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def register(pids: Iterable[int]) -> None:
    _PIDS.update(pids)


def unregister(pids: Iterable[int]) -> None:
    _PIDS.difference_update(pids)


def kill_leftovers() -> None:
    """Kill every launcher group and worker that a test started and did not see end (pytest session end)."""
    for pgid in list(_GROUPS):
        _kill_group(pgid)
    kill_pids(list(_PIDS))
    _GROUPS.clear()
    _PIDS.clear()


def run(cmd: Sequence[str], *, timeout: float | None = None, capture_output: bool = False, text: bool = False,
        input: str | bytes | None = None, check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose command and everything it starts (a launcher's workers) live in one process group,
    killed as a whole when the wait ends in any way, also after a normal exit (see [Note: reaping])."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = subprocess.Popen(cmd, start_new_session=True, text=text, **kwargs)
    _GROUPS.add(proc.pid)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
        _kill_group(proc.pid)
        try:
            proc.communicate(timeout=30)
        except BaseException:  # noqa: BLE001 - a grandchild that left the group may hold the pipes open
            proc.kill()
        raise
    finally:
        _kill_group(proc.pid)  # workers a launcher left behind when it exited
        _GROUPS.discard(proc.pid)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result
