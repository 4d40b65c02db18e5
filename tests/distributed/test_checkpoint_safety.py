"""A checkpoint crafted to run code if unpickled (see tests/crafted_checkpoints.py) is refused on every rank of a
load on the same world size and of a resharded load (2 ranks -> 1 and 1 -> 2), naming the problem, and no rank
runs its code; a genuine checkpoint's client state comes back on every rank. Real gloo processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zinf
from crafted_checkpoints import HOWS, craft
from dist_utils import run_distributed
from models import build, make_optimizer

pytestmark = pytest.mark.distributed

EXPECTED = {"client": "client state holds io.open", "record": "is not zinf's JSON record",
            "earlier": "is a zinf-sharded-v2 part"}


def _engine() -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    with zinf.Init(zinf.ZeroConfig()):
        model = build("gpt")
    return zinf.initialize(model, make_optimizer(model))


def _save(rank: int, world: int, path: str) -> None:
    engine = _engine()
    engine.save_checkpoint(path, client_state={"next": 4, "world": world})
    engine.close()


def _load(rank: int, world: int, paths: list[str]) -> list[dict]:
    """Load each of ``paths`` in turn into one engine (a refused load changes nothing)."""
    engine = _engine()
    out: list[dict] = []
    try:
        for path in paths:
            try:
                out.append({"client": engine.load_checkpoint(path)})
            except zinf.errors.CheckpointError as exc:
                out.append({"error": str(exc)})
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("saved_by,loaded_by", [(2, 1), (1, 2), (2, 2)])
def test_crafted_parts_are_refused_on_every_rank_and_run_nothing(tmp_path: Path, saved_by: int, loaded_by: int) -> None:
    genuine = tmp_path / "genuine"
    run_distributed(_save, saved_by, str(genuine))
    for how in HOWS:
        shutil.copytree(genuine, tmp_path / how)
        craft(tmp_path / how, how, tmp_path / f"ran-{how}")
    per_rank = run_distributed(_load, loaded_by, [str(genuine), *(str(tmp_path / how) for how in HOWS)])
    for rank, results in enumerate(per_rank):
        assert results[0] == {"client": {"next": 4, "world": saved_by}}, (rank, results[0])
        for how, result in zip(HOWS, results[1:]):
            assert EXPECTED[how] in result.get("error", ""), (rank, how, result)
    assert not [how for how in HOWS if (tmp_path / f"ran-{how}").exists()], "loading ran the checkpoint's code"
