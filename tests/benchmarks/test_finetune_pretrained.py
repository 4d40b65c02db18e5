"""benchmarks/finetune_pretrained.py on a tiny checkpoint, 2 ranks, LoRA with the base read in place: every rank
reports its load, its steps with each step's disk bound, and its compute bound, and the bounds are the figures they
say they are."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import processes
from zinf.offload.disk_speed import save_speed

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import make_pretrained as mp  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_ranks_report_steps_against_the_disk_and_compute_bounds(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    mp.write_pretrained(mp.llama_config("tiny"), ckpt, max_shard_bytes=50_000, seed=0, progress=False)
    out = tmp_path / "figures.json"
    (tmp_path / "swap").mkdir()
    save_speed(str(tmp_path / "swap"), write_gbs=1.0, read_gbs=2.0, direct=True)  # what `zinf info --nvme` keeps
    result = processes.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "benchmarks/finetune_pretrained.py"), str(ckpt), "--nvme", str(tmp_path / "swap"),
         "--steps", "2", "--seq", "16", "--precision", "fp32", "--storage", "bf16", "--pool-mib", "16",
         "--frozen-tile-kib", "16", "--out", str(out)],
        cwd=tmp_path, env=processes.env_without_launch(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("bounds: disk") == 2, result.stdout[-3000:]

    figures = json.loads(out.read_text())
    assert figures["world"] == 2 and figures["mode"] == "lora"
    for rank in figures["ranks"]:
        assert rank["load_read_bytes"] >= 0 and rank["peak_rss"] >= rank["rss_after_load"] > 0
        assert rank["matmul_flops_before"] > 0 and rank["matmul_flops_after"] > 0
        assert rank["step_flops"] == 4 * figures["parameters"] * 1 * 16  # LoRA: forward and input gradients
        # the base is read from the checkpoint's files, not copied to swap
        assert rank["resident"]["nvme"]["frozen_in_checkpoint"] > 0
        assert rank["frozen_linears_in_tiles"] > 0  # computed from their bf16 shards, a tile at a time
        assert rank["compute_bound_s"] == pytest.approx(rank["step_flops"] / rank["matmul_flops_before"])
        assert 0 < rank["linears_in_memory_s"] < min(s["seconds"] for s in rank["steps"])  # part of any step
        for step in rank["steps"]:
            assert math.isfinite(step["loss"]) and step["seconds"] > 0
            assert step["nvme_read"] > 0
    # the disk bound: both ranks' NVMe bytes at the measured speed, summed (the ranks share one disk)
    for a, b in zip(*(r["steps"] for r in figures["ranks"])):
        both = sum(s["nvme_read"] / 2e9 + s["nvme_written"] / 1e9 for s in (a, b))
        assert a["disk_bound_s"] == b["disk_bound_s"] == pytest.approx(both)

    # --ddp: the baseline, the same adapters, data and steps under DDP with the model in memory (fp32 values of the
    # bf16 checkpoint, as zinf computes from its bf16 shards, in tiles): the same losses but for the order of the sums
    ddp_out = tmp_path / "ddp.json"
    result = processes.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "benchmarks/finetune_pretrained.py"), str(ckpt), "--nvme", str(tmp_path / "swap"),
         "--steps", "2", "--seq", "16", "--precision", "fp32", "--ddp", "--out", str(ddp_out)],
        cwd=tmp_path, env=processes.env_without_launch(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ddp = json.loads(ddp_out.read_text())
    assert ddp["system"] == "ddp" and ddp["parameters"] == figures["parameters"]
    for zr, dr in zip(figures["ranks"], ddp["ranks"]):
        assert dr["step_flops"] == zr["step_flops"] and dr["linears_in_memory_s"] > 0
        for zs, ds in zip(zr["steps"], dr["steps"]):
            assert ds["loss"] == pytest.approx(zs["loss"], rel=1e-5), (ds["loss"], zs["loss"])


@pytest.mark.parametrize("kind,low,high", [("nf4", 0.5625, 0.57), ("int8", 1.0, 1.0 + 4 / 64)])
def test_qlora_reports_the_quantized_base(tmp_path: Path, kind: str, low: float, high: float) -> None:
    """``--qlora nf4``: the base's linear weights in 4 bits on NVMe (0.5625 bytes a parameter, and the padding to
    whole blocks); ``--qlora int8``: in 8 bits (a byte a parameter and a scale a row of at least 64); the steps
    finite."""
    pytest.importorskip("bitsandbytes")
    ckpt = tmp_path / "ckpt"
    mp.write_pretrained(mp.llama_config("tiny"), ckpt, max_shard_bytes=50_000, seed=0, progress=False)
    out = tmp_path / "figures.json"
    result = processes.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "benchmarks/finetune_pretrained.py"), str(ckpt), "--nvme", str(tmp_path / "swap"),
         "--steps", "2", "--seq", "16", "--precision", "fp32", "--pool-mib", "16", "--qlora", kind,
         *(["--double-quant"] if kind == "nf4" else []), "--out", str(out)],
        cwd=tmp_path, env=processes.env_without_launch(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in json.loads(out.read_text())["ranks"]:
        assert low <= rank["quantized_bytes_per_parameter"] <= high, rank["quantized_bytes_per_parameter"]
        assert rank["resident"]["nvme"]["param_shards"] > 0
        assert all(math.isfinite(step["loss"]) and step["nvme_read"] > 0 for step in rank["steps"])
