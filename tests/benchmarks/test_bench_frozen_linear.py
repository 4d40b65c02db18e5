"""``benchmarks/bench_frozen_linear.py`` runs and prints a row for each way and shape asked for. No timing is
checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frozen_linear.py"


def test_prints_each_way_for_each_shape() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "96x64,40x200", "--tile-kib", "1,4",
                           "--tokens", "8", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| weight", "| ---"))]
    ways = [(cells[0].strip(), cells[1].strip()) for cells in rows]
    assert ways == [(shape, way) for shape in ("96 x 64", "40 x 200")
                    for way in ("widen + F.linear", "F.linear", "tiles 1 KiB (16 rows)", "tiles 4 KiB (16 rows)")]
    assert all(float(cells[2]) > 0 and float(cells[3]) > 0 for cells in rows)
