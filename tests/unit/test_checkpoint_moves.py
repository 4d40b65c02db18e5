"""A sharded checkpoint moves between precisions (fp32 / bf16 compute, bf16 storage) and between front ends (the
plain engine and the engine the Lightning and Fabric strategies build over their step root): the fp32 masters,
the optimizer state and the step come back exactly. One process, real files."""

from __future__ import annotations

from pathlib import Path

import torch

import zinf
from lightning_zinf._shared import AdapterEngine, StepRoot
from models import batches, build, make_optimizer


def _engine(config: dict, seed: int = 0, root: bool = False) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(seed)
    model = build("gpt")
    cfg = zinf.ZeroConfig.from_dict(config)
    if root:
        return AdapterEngine(StepRoot(model), make_optimizer(model), cfg)
    return zinf.initialize(model, make_optimizer(model), cfg)


def _step(engine: zinf.ZeroInfinityEngine, root: bool = False) -> None:
    x, y = batches("gpt", 1, 4)[0]
    loss = engine("forward", x, y) if root else engine(x, y)
    engine.backward(loss)
    engine.step()


def _optimizer_state(engine: zinf.ZeroInfinityEngine) -> list[dict[str, torch.Tensor]]:
    return [engine.optimizer.group_state(g) for g in engine.groups]


def _same(a: zinf.ZeroInfinityEngine, b: zinf.ZeroInfinityEngine) -> None:
    fa, fb = a.full_state_dict(), b.full_state_dict()
    assert set(fa) == set(fb)
    assert all(torch.equal(fa[k], fb[k]) for k in fa), [k for k in fa if not torch.equal(fa[k], fb[k])][:4]
    for sa, sb in zip(_optimizer_state(a), _optimizer_state(b)):
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.global_step == b.global_step
    assert a.optimizer.state_meta()["scalars"] == b.optimizer.state_meta()["scalars"]


def test_precision_moves(tmp_path: Path) -> None:
    fp32 = _engine({})
    _step(fp32)
    fp32.save_checkpoint(str(tmp_path / "a"))
    bf16 = _engine({"precision": "bf16"}, seed=1)
    bf16.load_checkpoint(str(tmp_path / "a"))
    _same(fp32, bf16)
    bf16.save_checkpoint(str(tmp_path / "b"))
    stored = _engine({"param_storage": "bf16"}, seed=2)
    stored.load_checkpoint(str(tmp_path / "b"))
    _same(fp32, stored)


def test_front_end_moves(tmp_path: Path) -> None:
    lightning = _engine({}, root=True)
    _step(lightning, root=True)
    names = set(lightning.full_state_dict())
    assert names == set(build("gpt").state_dict()), "the step root's prefix leaks into the full state dict"
    lightning.save_checkpoint(str(tmp_path / "a"))
    plain = _engine({}, seed=1)
    plain.load_checkpoint(str(tmp_path / "a"))
    _same(lightning, plain)
    _step(plain)
    plain.save_checkpoint(str(tmp_path / "b"))
    back = _engine({}, seed=2, root=True)
    back.load_checkpoint(str(tmp_path / "b"))
    _same(plain, back)


def test_an_earlier_format_is_refused_with_the_fix(tmp_path: Path) -> None:
    import json

    import pytest

    from zinf.errors import CheckpointError

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "commit.json").write_text(json.dumps({"format": "zinf-commit-v1", "tag": "step1-ab",
                                                              "save_id": "ab", "global_step": 1, "world": 1}))
    with pytest.raises(CheckpointError, match="earlier zinf.*save it again"):
        _engine({}).load_checkpoint(str(tmp_path / "old"))
