"""Not collected by the suite: tests/suite/test_reaping.py runs it in a pytest of its own and interrupts it.

Each test starts workers that write their pids to $REAP_DIR and then wait forever; one worker stops itself
(state T, as a worker stopped by the terminal or a debugger), which SIGINT and SIGTERM never reach."""

from __future__ import annotations

import os
import signal
import sys
import time

import processes
from dist_utils import run_distributed

CHILD = """
import os, signal, subprocess, sys, time
d = sys.argv[1]
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
for k in kids:
    open(os.path.join(d, f"launcher-{k.pid}"), "w").close()
os.kill(kids[1].pid, signal.SIGSTOP)
open(os.path.join(d, f"launcher-{os.getpid()}"), "w").close()
time.sleep(600)
"""


def _wait_forever(rank: int, world: int, reap_dir: str) -> None:
    open(os.path.join(reap_dir, f"worker-{os.getpid()}"), "w").close()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


def test_workers_wait_forever() -> None:
    run_distributed(_wait_forever, 2, os.environ["REAP_DIR"])


def test_launcher_waits_forever() -> None:
    processes.run([sys.executable, "-c", CHILD, os.environ["REAP_DIR"]], timeout=600)
