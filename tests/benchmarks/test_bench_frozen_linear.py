"""``benchmarks/bench_frozen_linear.py`` runs and prints a row for each format, way and shape asked for, and the NF4
decoding's rates at each SIMD level this CPU has. No timing is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zinf import native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frozen_linear.py"


def test_prints_each_way_for_each_shape() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "96x64,40x128", "--tile-kib", "1,4",
                           "--tokens", "8", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| stored", "| SIMD", "| ---"))]
    matmuls = [cells for cells in rows if len(cells) == 6]
    assert [cells[:3] for cells in matmuls] == [
        [fmt, shape, way] for fmt in ("bf16", "nf4") for shape in ("96 x 64", "40 x 128")
        for way in ("widen + F.linear", "F.linear", "tiles 1 KiB (16 rows)", "tiles 4 KiB (16 rows)")]
    assert all(float(cells[3]) > 0 and float(cells[4]) > 0 for cells in matmuls)
    levels = [cells[0] for cells in rows if len(cells) == 3]
    assert levels == {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(
        native.info().simd_level, [])
