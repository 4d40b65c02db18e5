"""A checkpoint moves between world sizes and placements: 4 ranks (device) -> 2 (CPU-Adam, host) -> 1 (parameters
and optimizer state on NVMe) -> 4 (device, from the 2-rank and the 1-rank checkpoints). Each resumed run's losses
follow plain single-process PyTorch's uninterrupted run (fp32, clipping), step for step, and each rank reads only
the parts that hold its new shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import Recipe, reference, train_global

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCH, CLIP = 8, 0.5


def _offload(placement: str, work: str) -> dict:
    if placement == "device":
        return {}
    tier = "cpu" if placement == "cpu" else "nvme"
    return {"params": tier, "optimizer": tier, "nvme_paths": [work], "sub_group_numel": 4096,
            "pinned_pool_bytes": 4 << 20}


def _phase(rank: int, world: int, work: str, runs: list[dict]) -> list[dict]:
    """Each run: build an engine in ``placement``, load ``load`` (if any), train ``steps`` steps from ``start``,
    save to ``save`` (if any)."""
    out = []
    for run in runs:
        config = zinf.ZeroConfig.from_dict({"gradient_clipping": CLIP, "offload": _offload(run["placement"], work)})
        torch.manual_seed(100 + rank if run.get("load") else 0)  # loaded: every value must come from the checkpoint
        with zinf.Init(config):
            model = build("gpt")
        engine = zinf.initialize(model, make_optimizer(model), config)
        opened: list[int] = []
        client = _load(engine, run["load"], opened) if run.get("load") else None
        step = engine.global_step
        losses = train_global(engine, batches("gpt", run["start"] + run["steps"], BATCH)[run["start"]:], rank, world)
        if run.get("save"):
            engine.save_checkpoint(run["save"], client_state={"next": run["start"] + run["steps"]})
        out.append({"losses": losses, "step": step, "client": client, "opened": sorted(opened)})
        engine.close()
    return out


def _load(engine: zinf.ZeroInfinityEngine, ckpt: str, opened: list[int]) -> dict:
    """``engine.load_checkpoint``, noting which old ranks' parts this rank opens."""
    from zinf.checkpoint import sharded

    original = sharded.Checkpoint.part

    def noting(self: sharded.Checkpoint, k: int):  # noqa: ANN202 - returns the real reader
        if k not in self._parts:
            opened.append(k)
        return original(self, k)

    sharded.Checkpoint.part = noting
    try:
        return engine.load_checkpoint(ckpt)
    finally:
        sharded.Checkpoint.part = original


def test_checkpoints_move_across_world_sizes_and_placements(tmp_path: Path) -> None:
    work = str(tmp_path)
    c4, c2, c1 = (str(tmp_path / f"from{w}") for w in (4, 2, 1))
    ref = reference(Recipe(kind="gpt", steps=10, batch=BATCH, clip=CLIP))[0]
    results = {
        "4 device": run_distributed(_phase, 4, work, [{"placement": "device", "start": 0, "steps": 4, "save": c4}]),
        "4 -> 2 cpu": run_distributed(_phase, 2, work, [{"placement": "cpu", "load": c4, "start": 4, "steps": 2,
                                                          "save": c2}]),
        "2 -> 1 nvme": run_distributed(_phase, 1, work, [{"placement": "nvme", "load": c2, "start": 6, "steps": 2,
                                                           "save": c1}]),
    }
    both = run_distributed(_phase, 4, work, [{"placement": "device", "load": c2, "start": 6, "steps": 2},
                                             {"placement": "nvme", "load": c1, "start": 8, "steps": 2}])
    results["2 -> 4 device"] = [[r[0]] for r in both]
    results["1 -> 4 nvme"] = [[r[1]] for r in both]
    starts = {"4 device": 0, "4 -> 2 cpu": 4, "2 -> 1 nvme": 6, "2 -> 4 device": 6, "1 -> 4 nvme": 8}
    for name, per_rank in results.items():
        start = starts[name]
        for rank, (run,) in enumerate(per_rank):
            expected = ref[start : start + len(run["losses"])]
            rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], expected))
            assert rel < 1e-5, f"{name}, rank {rank}: losses {run['losses']} vs PyTorch's {expected} ({rel:.2e})"
            assert run["step"] == start, f"{name}: the step counter resumed at {run['step']}, not {start}"
            assert run["client"] == (None if start == 0 else {"next": start}), run["client"]
    # rank 0 of 2 holds the first half of every group: old ranks 0 and 1 only; rank 1 the second half (old ranks 2
    # and 3, and 1 where a small group's shards do not split evenly) and rank 0's buffers and client state
    opened = [run["opened"] for (run,) in results["4 -> 2 cpu"]]
    assert opened[0] == [0, 1] and {0, 2, 3} <= set(opened[1]), opened
    assert [run["opened"] for (run,) in results["2 -> 1 nvme"]] == [[0, 1]]
    assert not list(tmp_path.glob("*.swap")), "swap files must be removed when the engine closes"
