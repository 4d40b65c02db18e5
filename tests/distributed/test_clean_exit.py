"""A run ends with exit status 0 however the script ends, and a rank that dies leaves a line saying where.

- The stress runs (slow tier): a user's script (exit_script.py: DDP trains a transformers Llama and saves it, zinf
  loads it with ``from_pretrained`` under ``zinf.Init`` and trains it) under torchrun, N times ending tidily
  (``engine.close()``, ``destroy_process_group()``) and N times calling neither; and N/2 runs of a script whose last
  line is a collective (exit_collective_script.py), with the engine in memory and on NVMe with the background
  CPU-Adam (zinf's own threads running as the script ends). Every launch exits 0 and no rank prints C++'s
  "terminate called" (see [Note: the end of a run] in zinf/shutdown.py). N is ``ZINF_EXIT_RUNS`` (default 8, which
  keeps CI's end-to-end tier in its budget on 2 cores; ``ZINF_EXIT_RUNS=50`` for a longer hunt after a change to
  zinf/shutdown.py or the native threads).
- The fault line (slow tier too): a rank killed by a signal inside a zinf step (a bad memory access in the
  backward; an abort in a worker thread during the optimizer step) and a rank ended by an uncaught exception each
  leave a line naming the rank and the phase (see [Note: the fault line] in zinf/native/fault.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import processes

HERE = Path(__file__).resolve().parent
ABORT = "terminate called"
RUNS = int(os.environ.get("ZINF_EXIT_RUNS", "8"))
pytestmark = pytest.mark.distributed


def _torchrun(script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    env = {**processes.env_without_launch(), "OMP_NUM_THREADS": "1"}
    return processes.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _launches(script: Path, runs: int, args: list[str]) -> list[subprocess.CompletedProcess]:
    """``runs`` launches, two at a time (each launch waits on its rendezvous and exit as much as it computes)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda i: _torchrun(script, *[a.format(i=i) for a in args]), range(runs)))


def _failures(results: list[subprocess.CompletedProcess]) -> list[str]:
    return [f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}" for i, r in enumerate(results)
            if r.returncode != 0 or ABORT in r.stderr]


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["tidy", "bare"])
def test_the_script_exits_cleanly_every_time(ending: str, tmp_path: Path) -> None:
    results = _launches(HERE / "exit_script.py", RUNS, [str(tmp_path / "checkpoint-{i}"), ending])
    failed = _failures(results)
    assert not failed, f"{len(failed)} of {RUNS} runs ending {ending!r} failed:\n" + "\n".join(failed[:3])
    assert all(re.search(r"mean loss \d", r.stdout) for r in results)  # each run did its work


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["memory", "nvme"])
def test_a_script_ending_on_a_collective_exits_cleanly(placement: str, tmp_path: Path) -> None:
    runs = max(RUNS // 2, 1)
    failed = _failures(_launches(HERE / "exit_collective_script.py", runs, [placement, str(tmp_path)]))
    assert not failed, f"{len(failed)} of {runs} runs failed:\n" + "\n".join(failed[:3])
    assert not list(tmp_path.iterdir()), "swap files left behind"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "line"), [
    ("segv-backward", r"zinf: rank 1 of 2 \(pid \d+\) killed by SIGSEGV .* in its main thread during backward"),
    ("abort-thread-step", r"zinf: rank 1 of 2 \(pid \d+\) killed by SIGABRT .* in thread \d+ \(\S+\) during the "
                          r"optimizer step"),
    ("raise-forward", r"zinf: rank 1 of 2 ended by an uncaught RuntimeError during forward: a shape this block "
                      r"cannot take"),
])
def test_a_rank_that_dies_inside_a_step_says_where(mode: str, line: str) -> None:
    result = _torchrun(HERE / "fault_script.py", mode, timeout=120)
    assert result.returncode != 0
    assert re.search(line, result.stderr), result.stderr[-4000:]
    assert "rank 1 finished" not in result.stdout
