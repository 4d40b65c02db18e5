"""Checkpoints on node-local storage: 4 ranks as 2 simulated nodes of 2, each node saving into a directory of its
own (as with each node's own disk). The commit record knows every part and where it is, every node's directory
holds it, a resume on the same layout continues exactly, and another world size is refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from training import train_global
from zinf.errors import CheckpointError

pytestmark = pytest.mark.distributed


def _node_dir(root: str, rank: int, per_node: int) -> str:
    return str(Path(root) / f"node{rank // per_node}" / "ckpt")


def _engine() -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    with zinf.Init():
        model = build("gpt")
    return zinf.initialize(model, make_optimizer(model), zinf.ZeroConfig(gradient_clipping=1.0))


def _save_and_resume(rank: int, world: int, root: str, per_node: int) -> dict:
    ckpt = _node_dir(root, rank, per_node)
    data = batches("gpt", 6, 8)
    first = _engine()
    train_global(first, data[:2], rank, world)
    first.save_checkpoint(ckpt, client_state={"at": 2})
    train_global(first, data[2:3], rank, world)
    first.save_checkpoint(ckpt, client_state={"at": 3})  # replaces the first save on every node
    straight = train_global(first, data[3:], rank, world)
    first.close()
    second = _engine()
    client, step = second.load_checkpoint(ckpt), second.global_step
    return {"straight": straight, "resumed": train_global(second, data[3:], rank, world), "client": client, "step": step}


def _load_on_other_world(rank: int, world: int, root: str) -> str:
    try:
        _engine().load_checkpoint(_node_dir(root, rank, 1))
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_node_local_directories(tmp_path: Path) -> None:
    root = str(tmp_path)
    results = run_distributed(_save_and_resume, 4, root, 2)
    for r in results:
        assert r["client"] == {"at": 3} and r["step"] == 3, r
        assert r["resumed"] == r["straight"], "the resumed run differs from the uninterrupted one"
    records = [json.loads((tmp_path / f"node{n}" / "ckpt" / "commit.json").read_text()) for n in (0, 1)]
    assert records[0] == records[1], "every node's directory holds the same commit record"
    assert records[0]["storage"] == [0, 0, 2, 2] and len(records[0]["files"]) == 4, records[0]
    for n in (0, 1):  # each node holds its own ranks' parts of the current save, and nothing of the first save
        parts = sorted(p.name for p in (tmp_path / f"node{n}" / "ckpt").glob("*.safetensors"))
        assert parts == sorted(records[0]["files"][2 * n : 2 * n + 2]), parts
    msgs = run_distributed(_load_on_other_world, 2, root)
    assert all("each node holds alone" in m and "shared directory" in m for m in msgs), msgs
