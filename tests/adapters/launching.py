"""Launching a front end for real from a test: ``accelerate launch`` and ``zinf launch`` of a script on gloo
processes (or any launcher command), with every rank's traceback in the failure message and nothing left running
afterwards (see [Note: reaping] in tests/processes.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import processes

__all__ = ["ROOT", "EXAMPLES", "run_launcher", "failure_message", "accelerate_launch", "zinf_launch", "assert_close"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "accelerate"
TORCH_EXIT_ABORT = "terminate called without an active exception"
EXIT_ABORT_RETRIES = 3
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:")


def _tracebacks(stderr: str, limit: int = 6) -> list[str]:
    """The distinct Python tracebacks in ``stderr`` (each rank's, torchrun's ``[rankN]:`` prefixes kept), up to
    the exception line that ends each, launchers' own ``ChildFailedError`` left out."""
    lines = stderr.splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last):" not in line:
            continue
        block = [line]
        for nxt in lines[i + 1:]:
            block.append(nxt)
            body = _RANK_PREFIX.sub("", nxt)
            if body and not body[0].isspace():
                break  # the exception line
        text = "\n".join(block)
        if "ChildFailedError" not in block[-1] and text not in found:
            found.append(text)
    return found[:limit]


def failure_message(cmd: Sequence[str], proc: subprocess.CompletedProcess) -> str:
    """What a failed launch shows: the command, its exit status, every rank's traceback, then the output's tails."""
    stderr, stdout = proc.stderr or "", proc.stdout or ""
    traces = "\n\n".join(t[-4000:] for t in _tracebacks(stderr)) or "(no Python traceback in stderr)"
    return (f"{' '.join(map(str, cmd))} failed ({proc.returncode}).\n--- the ranks' tracebacks ---\n{traces}\n"
            f"--- stdout (tail) ---\n{stdout[-2000:]}\n--- stderr (tail) ---\n{stderr[-4000:]}")


def _ends_in_torch_exit_abort(proc: subprocess.CompletedProcess) -> bool:
    """True when a launch failed only by torch's exit abort: its message, and no Python traceback before it."""
    stderr = proc.stderr or ""
    return proc.returncode != 0 and TORCH_EXIT_ABORT in stderr and \
        "Traceback (most recent call last):\n  File" not in stderr.split(TORCH_EXIT_ABORT)[0]


def run_launcher(cmd: list[str], *, env: dict[str, str] | None = None, ok: bool = True, cwd: Path = ROOT,
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a launcher command with one thread per process (the same CPU reduction order in every run), without a
    zinf config or ACCELERATE_USE_CPU from the test's own environment unless ``env`` sets them."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "ZINF_CONFIG", "MASTER_PORT")}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    proc = processes.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    for _ in range(EXIT_ABORT_RETRIES):
        if not (ok and _ends_in_torch_exit_abort(proc)):
            break
        # torch 2.13's gloo can abort a process at interpreter exit after its work is done (docs/known_issues.md);
        # a plain DDP reference run has no zinf exit handler to prevent it, and on a loaded machine it can happen
        # twice running. The run itself succeeded (no traceback before the abort): run it again. Any other
        # failure fails; zinf's own exits are held to 0 aborts in tests/distributed/test_clean_exit.py.
        proc = processes.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if ok and proc.returncode != 0:
        raise AssertionError(failure_message(cmd, proc))
    return proc


def accelerate_launch(config: str | Path, script: str | Path, *args: str | Path,
                      env: dict[str, str] | None = None) -> None:
    run_launcher([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script),
                  *map(str, args)], env={"ACCELERATE_USE_CPU": "true", **(env or {})})


def zinf_launch(flag: str, config: str | Path, script: str | Path, *args: str | Path,
                env: dict[str, str] | None = None) -> None:
    run_launcher([sys.executable, "-m", "zinf.cli", "launch", flag, str(config), str(script), *map(str, args)], env=env)


def assert_close(a: list[float], b: list[float], rtol: float) -> float:
    """The largest relative difference of ``b`` from ``a``, step by step; fails above ``rtol``."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    assert worst <= rtol, f"max relative loss difference {worst:.3g} > {rtol}: {a} vs {b}"
    return worst
