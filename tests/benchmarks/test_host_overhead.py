"""The host work of a step, counted (benchmarks/bench_host_overhead.py --smoke, 1 and 2 gloo ranks): the counts are
deterministic, so they are asserted here; the times it prints are not checked.

After the recorded step, on dense models (transformers' GPT-2 and Llama module trees): zinf's forward + backward
makes no blocking device sync beyond what plain PyTorch's own model code makes, issues at most as many collectives
carrying device tensors as FSDP2 (one per round's gathers and per gradient bucket), its control messages stay on the
host (see [Note: host-side agreement] in zinf/runtime/comm.py), and it makes at most as many stream and event calls
as FSDP2; with one rank in memory, where nothing moves, none at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import processes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_overhead.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("host_overhead")
    proc = processes.run([sys.executable, str(BENCH), "--smoke", "--models", "gpt2:host,llama:host", "--systems",
                          "plain,fsdp2,zinf", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "| model | world | system |" in proc.stdout
    return json.loads((out / "host_overhead.json").read_text())


def _row(rows: list[dict[str, Any]], model: str, world: int, system: str) -> dict[str, Any]:
    return next(r for r in rows if r["model"] == model and r["world"] == world and r["system"] == system)


@pytest.mark.parametrize("model", ["gpt2:host", "llama:host"])
def test_no_blocking_sync_in_forward_and_backward(rows: list[dict[str, Any]], model: str) -> None:
    for world in (1, 2):
        plain, zinf = _row(rows, model, world, "plain"), _row(rows, model, world, "zinf")
        assert zinf["syncs_forward_backward"] == plain["syncs_forward_backward"], (world, zinf, plain)


@pytest.mark.parametrize("model", ["gpt2:host", "llama:host"])
def test_collectives_and_stream_calls_at_most_fsdp2s(rows: list[dict[str, Any]], model: str) -> None:
    fsdp2, zinf = _row(rows, model, 2, "fsdp2"), _row(rows, model, 2, "zinf")
    assert 0 < zinf["num_collectives"] <= fsdp2["num_collectives"], (zinf["collectives"], fsdp2["collectives"])
    assert zinf["stream_calls"] <= fsdp2["stream_calls"], (zinf["stream_calls_by_kind"], fsdp2["stream_calls_by_kind"])
    # the control messages are host collectives (a gloo group beside NCCL), never on the device's backend
    assert zinf["num_host_collectives"] > 0
    one = _row(rows, model, 1, "zinf")
    assert one["stream_calls"] == 0 and one["num_collectives"] == 0, one
