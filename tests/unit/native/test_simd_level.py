"""``ZINF_SIMD`` names a SIMD level of the CPU-Adam or is refused at import, naming the levels (a misspelt level
would otherwise run at the CPU's best one, and a test meant for an AVX2 machine would check AVX-512)."""

from __future__ import annotations

import os
import subprocess
import sys


def _import_with(level: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ZINF_SIMD": level}
    return subprocess.run([sys.executable, "-c", "import zinf.native as n; print(n.info().simd_level)"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_misspelt_level_is_refused() -> None:
    for level in ("Scalar", "avx-2", "sse"):
        done = _import_with(level)
        assert done.returncode != 0 and f"ZINF_SIMD={level!r}" in done.stderr and "'avx2'" in done.stderr


def test_a_level_is_taken() -> None:
    done = _import_with("scalar")
    assert done.returncode == 0 and done.stdout.split()[-1] in ("scalar", "none"), done.stderr
