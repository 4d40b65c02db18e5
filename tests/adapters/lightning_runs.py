"""Lightning and Fabric driver runs for the adapter tests: each driver script is started once per distinct argument
list (under torchrun, or as ``python driver.py`` with Lightning's own launcher starting the second rank), and every
rank's record is read back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import processes
from launching import failure_message

__all__ = ["HERE", "ROOT", "WORLD", "Runs", "records", "max_rel", "worst"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORLD = 2


class Runs:
    """Runs a driver once per distinct argument list; returns the per-rank records.

    How the ranks start: ``torchrun`` starts both at once (Lightning and Fabric take its environment, as on a
    cluster), so they import Lightning side by side (about 5 s of each run's 14 on this 2-core machine);
    ``launcher="lightning"`` runs the script as ``python driver.py`` and Lightning's own launcher starts the
    second rank, as a user does on one machine (tests that need that path ask for it)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.done: dict[tuple, Path] = {}

    def __call__(self, driver: str, *args: str, launcher: str = "torchrun") -> Path:
        key = (driver, *args, launcher)
        if key not in self.done:
            out = self.base / f"run{len(self.done)}"
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            env.pop("MASTER_PORT", None)
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default; Lightning's launcher would take cores / ranks
            if launcher == "lightning":
                start = [sys.executable, str(HERE / driver)]
            else:  # --standalone: torchrun's own rendezvous on a free port
                start = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                         str(HERE / driver)]
            cmd = [*start, *args, "--out", str(out)]
            proc = processes.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(HERE))
            if proc.returncode != 0:
                raise AssertionError(failure_message(cmd, proc))
            self.done[key] = out
        return self.done[key]


def records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def worst(ours: list[dict], ref: list[dict], key: str = "train", scale: float = 1.0, start: int = 0) -> float:
    return max(max_rel([v * scale for v in o[key]], r[key][start:]) for o, r in zip(ours, ref))
