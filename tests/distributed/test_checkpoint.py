"""A sharded checkpoint resumes exactly, consolidates to the full state dict, and refuses bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer
from zinf.checkpoint import consolidate
from zinf.checkpoint.sharded import CheckpointError

pytestmark = pytest.mark.distributed


def _engine(config: zinf.ZeroConfig, sgd: bool = False) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    with zinf.Init(config):
        model = build("gpt")
    # SGD's momentum buffer is its only state, all per-element: a parameter's scalars are then an empty record
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if sgd else make_optimizer(model)
    return zinf.initialize(model, opt, config)


def _train(engine: zinf.ZeroInfinityEngine, data, rank: int, world: int) -> list[float]:
    out = []
    for x, y in data:
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _resume(rank: int, world: int, ckpt: str, precision: str) -> dict:
    offload, sgd = {}, precision == "fp32+sgd"
    precision = "fp32" if sgd else precision
    if precision == "fp32+nvme":  # parameters and Adam states on NVMe, the step in the background
        precision, offload = "fp32", {"params": "nvme", "optimizer": "nvme", "nvme_paths": [os.path.dirname(ckpt)],
                                      "pinned_pool_bytes": 4 << 20}
    config = zinf.ZeroConfig.from_dict({"precision": precision, "gradient_clipping": 1.0, "offload": offload})
    data = batches("gpt", 16, 8)
    first = _engine(config, sgd)
    _train(first, data[:8], rank, world)
    first.save_checkpoint(ckpt, client_state={"epoch": 3})
    straight = _train(first, data[8:], rank, world)
    full = first.full_state_dict()
    first.close()
    second = _engine(config, sgd)
    client = second.load_checkpoint(ckpt)
    resumed = _train(second, data[8:], rank, world)
    return {"straight": straight, "resumed": resumed, "client": client, "step": second.global_step, "full": full}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32+nvme", "fp32+sgd"])
def test_resume_matches_uninterrupted_run(tmp_path: Path, precision: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_resume, 2, ckpt, precision)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["straight"], (
            f"rank {rank} ({precision}): resumed run differs from the uninterrupted one:\n"
            f"resumed  {r['resumed']}\nstraight {r['straight']}")
        assert r["client"] == {"epoch": 3} and r["step"] == 16
    state = consolidate(ckpt)
    torch.manual_seed(0)
    plain = build("gpt")
    assert set(state) == set(plain.state_dict()), "consolidated keys differ from the model's state_dict"
    plain.load_state_dict(state)  # loads into an ordinary model


def _save_only(rank: int, world: int, ckpt: str) -> None:
    _engine(zinf.ZeroConfig()).save_checkpoint(ckpt)


def _load_only(rank: int, world: int, ckpt: str) -> str:
    try:
        _engine(zinf.ZeroConfig()).load_checkpoint(ckpt)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_only, 2, ckpt)
    victim = tmp_path / "ckpt" / json.loads((tmp_path / "ckpt" / "commit.json").read_text())["files"][1]
    good = victim.read_bytes()
    victim.write_bytes(good[:1000])  # truncated inside the header
    msgs = run_distributed(_load_only, 2, ckpt)
    assert "truncated" in msgs[1] and msgs[0] == msgs[1], msgs
    victim.write_bytes(good[: len(good) - 100])  # truncated inside the tensors
    assert "truncated" in run_distributed(_load_only, 2, ckpt)[1]
    torch.save({"something": "else"}, victim)  # foreign: a torch file
    assert "not a checkpoint part" in run_distributed(_load_only, 2, ckpt)[1]
    from safetensors.torch import save_file
    victim.unlink()
    save_file({"w": torch.zeros(3)}, str(victim))  # foreign: a safetensors file that is not a zinf part
    assert "not a zinf checkpoint part" in run_distributed(_load_only, 2, ckpt)[1]
