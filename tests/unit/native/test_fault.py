"""The fault line's text and phases (zinf/native/fault.py, zinf/shutdown.py); test_clean_exit.py kills real ranks."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from zinf import native
from zinf.native import fault
from zinf.shutdown import phase

needs_native = pytest.mark.skipif(not native.info().available, reason="the fault line is written by the C++ core")


@needs_native
def test_the_line_names_rank_signal_thread_and_phase() -> None:
    fault.install(3, 4)
    with phase("forward"):
        line = fault.describe(signal.SIGSEGV)
    assert line.startswith("zinf: rank 3 of 4 (pid ")
    assert "killed by SIGSEGV (an invalid memory access) in its main thread during forward\n" in line
    assert fault.describe(signal.SIGABRT).endswith("during the script's own code (outside zinf's calls)\n")


def test_phases_nest_and_unwind() -> None:
    with phase("the optimizer step"):
        with pytest.raises(ValueError), phase("saving a checkpoint"):
            raise ValueError("full disk")
        assert fault.current_phase() == "the optimizer step"
    assert fault.current_phase() == ""


@needs_native
def test_a_fatal_signal_goes_on_to_faulthandler_and_kills() -> None:
    """The line, then Python's faulthandler dump (installed before), then death by the same signal."""
    code = ("import faulthandler, os; faulthandler.enable(); from zinf.native import fault; fault.install(0, 1); "
            "fault.set_phase('closing the engine'); os.abort()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGABRT
    lines = proc.stderr.splitlines()
    assert "killed by SIGABRT" in lines[0] and lines[0].endswith("in its main thread during closing the engine")
    assert "Fatal Python error: Aborted" in proc.stderr
