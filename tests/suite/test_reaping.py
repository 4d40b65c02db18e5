"""An interrupted test run leaves no process behind ([Note: reaping] in tests/processes.py).

A pytest of its own runs tests/suite/interrupt_target.py, whose workers record their pids and wait forever,
one of them stopped (state T). Ctrl-C is sent as a terminal sends it, to the whole foreground process group;
pytest must then end within seconds, and none of the recorded processes may still exist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import processes

HERE = Path(__file__).parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("target,expected", [("test_workers_wait_forever", "worker-"),
                                              ("test_launcher_waits_forever", "launcher-")])
@pytest.mark.slow
def test_ctrl_c_leaves_no_process(tmp_path: Path, target: str, expected: str) -> None:
    env = {**os.environ, "REAP_DIR": str(tmp_path), "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{HERE / 'interrupt_target.py'}::{target}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=processes.default_sigint)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob(f"{expected}*"))) < (2 if expected == "worker-" else 3):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the target's workers did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pids = [int(p.name.split("-")[1]) for p in tmp_path.glob(f"{expected}*")]
    time.sleep(0.5)  # orphans are reaped by init
    survivors = [pid for pid in pids if _alive(pid)]
    assert not survivors, f"processes left after Ctrl-C: {survivors}\n{out[-3000:]}"
    assert "KeyboardInterrupt" in out or "Interrupted" in out, out[-3000:]
