"""``zinf consolidate`` gives the names of the model the user built, whatever front end trained it.

The Lightning and Fabric strategies run the user's module under a step root, so every name the engine
records starts with ``module.``; each checkpoint part records that prefix (``name_prefix``) and
``consolidate`` removes it. Checked on a real 2-rank Lightning run (checkpoints of this zinf and of an
earlier one, which recorded no prefix) and on single-process engines (plain models keep their names).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from lightning_zinf import consolidate_state_dict
from lightning_zinf._shared import build_engine, module_names
from zinf.checkpoint import consolidate
import processes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _consolidate_cli(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    result = processes.run([sys.executable, "-m", "zinf.cli", "consolidate", str(ckpt), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def _parts(ckpt: Path) -> list[dict]:
    return [torch.load(f, weights_only=False) for f in sorted(ckpt.glob("step*.pt"))]


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("consolidate_keys")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MASTER_PORT", None)
    proc = processes.run([sys.executable, str(HERE / "consolidate_driver.py"), "--steps", "6", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=str(HERE))
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("which", ["ckpt", "legacy"])
def test_lightning_checkpoint_consolidates_to_the_lightning_module_names(lightning_run: Path, which: str) -> None:
    sys.path.insert(0, str(HERE))
    from consolidate_driver import Wrapped

    ckpt = lightning_run / which
    parts = _parts(ckpt)
    assert len(parts) == 2
    assert [p.get("name_prefix") for p in parts] == (["module."] * 2 if which == "ckpt" else [None] * 2)
    assert all(n.startswith("module.module.") or n == "module.scale"
               for g in parts[0]["layout"] for prm in g["params"] for n in prm["names"])

    state = _consolidate_cli(ckpt, lightning_run / f"{which}.pt")
    fresh = Wrapped()
    fresh.configure_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    fresh.load_state_dict(state)  # strict: the LightningModule's own names, no wrapper prefix
    assert set(state) == set(fresh.state_dict())

    trained = torch.load(lightning_run / "trained.pt", weights_only=True)
    assert set(trained) == set(state)
    for k, v in trained.items():
        assert torch.equal(state[k], v), k
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not torch.equal(before["module.wte.weight"], state["module.wte.weight"])  # it trained
    assert int(state["seen"]) == 6
    # the adapter's own consolidation agrees (the prefix is removed once, not twice)
    adapter = consolidate_state_dict(ckpt)
    assert set(adapter) == set(state) and all(torch.equal(adapter[k], v) for k, v in state.items())


@pytest.mark.distributed
def test_recording_the_prefix_leaves_the_layout_a_resume_checks_unchanged(lightning_run: Path) -> None:
    new, old = _parts(lightning_run / "ckpt"), _parts(lightning_run / "legacy")
    assert [p["layout"] for p in new] == [p["layout"] for p in old]
    assert [p["tiling"] for p in new] == [p["tiling"] for p in old]


class Holder(nn.Module):
    """A plain model whose child is named ``module``, as a DDP-style wrapper's is."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
        self.register_buffer("count", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x).sum()


def _trained_engine(engine: zinf.ZeroInfinityEngine, call) -> None:
    for _ in range(2):
        loss = call(torch.randn(5, 4))
        engine.backward(loss)
        engine.step()


def test_plain_engine_keeps_its_names_even_under_a_child_named_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Holder()
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    _trained_engine(engine, engine)
    expected = engine.full_state_dict()
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 1})
    assert "name_prefix" not in _parts(tmp_path / "ckpt")[0]
    state = _consolidate_cli(tmp_path / "ckpt", tmp_path / "full.pt")
    fresh = Holder()
    fresh.load_state_dict(state)  # strict
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


def test_step_root_engine_records_its_prefix_and_consolidates_to_the_module_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Holder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = build_engine(model, [opt], zinf.ZeroConfig(), torch.device("cpu"))
    _trained_engine(engine, lambda x: engine("forward", x))
    expected = engine.full_state_dict()  # the engine's names: under the step root
    assert all(k.startswith("module.module.") or k == "module.count" for k in expected)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert _parts(tmp_path / "ckpt")[0]["name_prefix"] == "module."
    state = consolidate(tmp_path / "ckpt")
    fresh = Holder()
    fresh.load_state_dict(state)  # strict
    assert all(torch.equal(state[k[len("module."):]], v) for k, v in expected.items())
    assert set(consolidate(tmp_path / "ckpt", prefix="")) == set(expected)  # the engine's names, on request
    # a state dict with the engine's names or the module's goes into the module under the module's names
    assert set(module_names(expected, fresh)) == set(fresh.state_dict())
    assert set(module_names(state, fresh)) == set(fresh.state_dict())
