"""benchmarks/gpu_check.py --smoke: every part of the GPU check runs on the CPU with tiny models and writes its
results folder; the GPU tests are reported as skipped, not run. No timing is checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import processes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GOALS = 11  # tests/gpu, six step ratios (two of them compiled), MFU, two NVMe bounds, two ranks


def test_gpu_check_smoke(tmp_path: Path) -> None:
    proc = processes.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path),
                          "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("-cpu-smoke")]
    results = json.loads((folder / "results.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["tests", "nvme", "ranks", "host", "side_by_side"]
    assert parts["tests"]["status"] == "skipped" and parts["tests"]["cases"], parts["tests"]["note"]
    assert all(c["outcome"] == "skipped" for c in parts["tests"]["cases"])
    for key in ("nvme", "ranks", "host", "side_by_side"):
        assert parts[key]["status"] == "passed", (key, parts[key]["note"])
    rows = parts["side_by_side"]["rows"]
    assert sorted(r["system"] for r in rows) == sorted(["plain", "fsdp2", "fsdp2-offload", "zinf-mem", "zinf-optcpu",
                                                        "zinf-optcpu-share", "zinf-cpu", "zinf-nvme", "zinf-mem+compile", "fsdp2+compile",
                                                        "zinf-nvme-gradcpu"])
    assert all(r["precision"] == "bf16" and r["tokens_per_s"] > 0 for r in rows)
    assert parts["nvme"]["read_gbs"] > 0 and parts["host"]["profile"]["top_host_ops"]
    assert all(v["max_rel_loss_diff"] <= parts["ranks"]["rtol"] for v in parts["ranks"]["compared"].values())
    goals = results["goals"]
    assert len(goals) == GOALS and all(g["result"] in ("met", "missed", "not measured") for g in goals)
    assert goals[0]["result"] == "not measured"  # no GPU test ran
    assert sum(g["result"] != "not measured" for g in goals) == GOALS - 1, goals
    summary = (folder / "summary.md").read_text()
    assert "Smoke run" in summary and "| zinf in memory | 1 |" in summary
    assert (folder / "pytest.log").read_text()


def test_gpu_check_runs_the_rows_asked_for(tmp_path: Path) -> None:
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    bad = processes.run([sys.executable, script, "--smoke", "--out", str(tmp_path), "--systems", "zinf-nvme,ddp"],
                        capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--systems: unknown ['ddp']" in bad.stderr, bad.stderr[-2000:]
    proc = processes.run([sys.executable, script, "--smoke", "--out", str(tmp_path), "--work-dir", str(tmp_path / "w"),
                          "--parts", "nvme,side_by_side", "--systems", "zinf-nvme"],
                         capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("-cpu-smoke")]
    results = json.loads((folder / "results.json").read_text())
    assert list(results["parts"]) == ["nvme", "side_by_side"]
    assert [r["system"] for r in results["parts"]["side_by_side"]["rows"]] == ["zinf-nvme"]
    nvme_goal = [g for g in results["goals"] if g["goal"].startswith("NVMe step")]
    assert nvme_goal and nvme_goal[0]["result"] in ("met", "missed"), results["goals"]
