"""Each comparison benchmark's ``--smoke`` mode runs (a tiny model, 2 steps, in fresh processes) and prints its
table; ``--plot`` redraws the PNG from the raw JSON. DeepSpeed is made absent here (it lives in a venv of its own
that CI does not have), so its rows must say "skipped". No timing is checked: these runs only prove the scripts
work. The three run at the same time; bench_rounds.py (its own table, no files) after them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import processes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = {  # script -> (a line of its table's header, the raw JSON's stem)
    "bench_side_by_side.py": ("| model | params | system | ranks | step s | tokens/s | GFLOP/s | % of peak |", "side_by_side"),
    "bench_size_curve.py": ("| system | n_layer | params | step s | tokens/s | peak RSS / rank GiB |", "size_curve"),
    "bench_ranks_curve.py": ("| system | ranks | params | step s | tokens/s | peak RSS / rank GiB |", "ranks_curve"),
}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The three scripts' smoke runs, started together (each is mostly processes starting and waiting for each
    other, so together they take about half the time)."""
    env = {**os.environ, "ZINF_BENCH_DS_PYTHON": str(tmp_path_factory.mktemp("no-deepspeed-venv") / "python")}

    def smoke(script: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path_factory.mktemp(script.removesuffix(".py"))
        return processes.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out)], env=env,
                             capture_output=True, text=True, timeout=240), out

    with ThreadPoolExecutor(len(SCRIPTS)) as pool:
        return dict(zip(SCRIPTS, pool.map(smoke, SCRIPTS)))


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_smoke(script: str, smoke_runs: dict[str, tuple[subprocess.CompletedProcess, Path]]) -> None:
    header, stem = SCRIPTS[script]
    proc, out = smoke_runs[script]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert header in proc.stdout, proc.stdout
    assert "skipped: no DeepSpeed interpreter" in proc.stdout, "DeepSpeed's rows say why they did not run"
    rows = json.loads((out / f"{stem}.json").read_text())["rows"]
    ran = [r for r in rows if not r["system"].startswith("ds-")]
    assert ran and all(r["status"] == "ok" for r in ran), [(r["system"], r.get("detail")) for r in ran]
    assert (out / f"{stem}.csv").is_file() and (out / "table.md").is_file()
    png = out / f"{stem}.png"
    png.unlink()
    redraw = processes.run([sys.executable, str(BENCH / script), "--plot", str(out / f"{stem}.json")],
                           capture_output=True, text=True, timeout=120)
    assert redraw.returncode == 0, redraw.stderr[-3000:]
    assert header in redraw.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rounds_smoke() -> None:
    """bench_rounds.py (DDP and zinf in five settings, taking turns in the same two processes) prints both rows."""
    proc = processes.run([sys.executable, str(BENCH / "bench_rounds.py"), "--smoke"], capture_output=True, text=True,
                         timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "| model | params | DDP s/step | zinf s/step | zinf / DDP | rounds/step |" in proc.stdout, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| dense |", "| moe |"))]
    assert len(rows) == 2 and all(line.count("|") == 17 for line in rows), proc.stdout
