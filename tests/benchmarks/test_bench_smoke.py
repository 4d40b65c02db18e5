"""Each comparison benchmark's ``--smoke`` mode runs (a tiny model, 2 steps, in fresh processes) and prints its
table; ``--plot`` redraws the PNG from the raw JSON. DeepSpeed is made absent here (it lives in a venv of its own
that CI does not have), so its rows must say "skipped". No timing is checked: these runs only prove the scripts
work."""

from __future__ import annotations

import json
import os
import sys
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


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_smoke(script: str, tmp_path: Path) -> None:
    header, stem = SCRIPTS[script]
    env = {**os.environ, "ZINF_BENCH_DS_PYTHON": str(tmp_path / "no-deepspeed-venv" / "python")}
    proc = processes.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert header in proc.stdout, proc.stdout
    assert "skipped: no DeepSpeed interpreter" in proc.stdout, "DeepSpeed's rows say why they did not run"
    rows = json.loads((tmp_path / f"{stem}.json").read_text())["rows"]
    ran = [r for r in rows if not r["system"].startswith("ds-")]
    assert ran and all(r["status"] == "ok" for r in ran), [(r["system"], r.get("detail")) for r in ran]
    assert (tmp_path / f"{stem}.csv").is_file() and (tmp_path / "table.md").is_file()
    png = tmp_path / f"{stem}.png"
    png.unlink()
    redraw = processes.run([sys.executable, str(BENCH / script), "--plot", str(tmp_path / f"{stem}.json")],
                           capture_output=True, text=True, timeout=120)
    assert redraw.returncode == 0, redraw.stderr[-3000:]
    assert header in redraw.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
