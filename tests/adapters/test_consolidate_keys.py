"""``zinf consolidate`` gives the names of the model the user built, whatever front end trained it.

The Lightning and Fabric strategies run the user's module under a step root, so every name inside the engine
starts with ``module.``; the engine removes that prefix wherever names leave it (``engine.name_prefix``), so
``full_state_dict()``, the checkpoint's record and ``consolidate`` all carry the LightningModule's own names.
Checked on a real 2-rank Lightning run (its model is a child named ``module``, so a prefix removed twice or not
at all shows) and on single-process engines (plain models keep their names).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from lightning_zinf import consolidate_state_dict, convert_to_lightning_checkpoint
from lightning_zinf._shared import build_engine, module_names
from zinf.checkpoint import consolidate, open_checkpoint
import processes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _consolidate_cli(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    result = processes.run([sys.executable, "-m", "zinf.cli", "consolidate", str(ckpt), str(out), "-q"],
                           capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)


def _recorded_names(ckpt: Path) -> tuple[int, list[str], list[str]]:
    """The world, parameter names and buffer names a checkpoint records (rank 0's part)."""
    with open_checkpoint(ckpt) as checkpoint:
        meta = checkpoint.part(0).meta
        world = checkpoint.commit.world
    return world, [n for g in meta["layout"] for prm in g["params"] for n in prm["names"]], list(meta["buffers"])


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("consolidate_keys")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MASTER_PORT", None)
    proc = processes.run([sys.executable, str(HERE / "consolidate_driver.py"), "--steps", "6", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=str(HERE))
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_lightning_checkpoint_consolidates_to_the_lightning_module_names(lightning_run: Path) -> None:
    sys.path.insert(0, str(HERE))
    from consolidate_driver import Wrapped

    fresh = Wrapped()
    fresh.configure_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    own = set(fresh.state_dict())
    assert "scale" in own and "seen" in own and "module.wte.weight" in own

    # the engine's full state dict has the LightningModule's own state_dict() names, no step-root prefix
    trained = torch.load(lightning_run / "trained.pt", weights_only=True)
    assert set(trained) == set(json.loads((lightning_run / "module_names.json").read_text())) == own
    assert not any(k.startswith("module.module.") for k in trained)

    # so does the checkpoint's record
    world, params, buffers = _recorded_names(lightning_run / "ckpt")
    assert world == 2 and buffers == ["seen"] and set(params) | set(buffers) == own

    state = _consolidate_cli(lightning_run / "ckpt", lightning_run / "ckpt.pt")
    fresh.load_state_dict(state)  # strict: the LightningModule's own names
    assert set(state) == own
    for k, v in trained.items():
        assert torch.equal(state[k], v), k
        assert torch.equal(fresh.state_dict()[k], v), k
    assert not torch.equal(before["module.wte.weight"], state["module.wte.weight"])  # it trained
    assert int(state["seen"]) == 6
    # the adapter's own consolidation agrees (nothing is stripped a second time)
    adapter = consolidate_state_dict(lightning_run / "ckpt")
    assert set(adapter) == own and all(torch.equal(adapter[k], v) for k, v in state.items())
    converted = convert_to_lightning_checkpoint(lightning_run / "ckpt")
    assert converted["global_step"] == 6 and set(converted["state_dict"]) == own


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
    _, params, buffers = _recorded_names(tmp_path / "ckpt")
    assert set(params) | set(buffers) == set(Holder().state_dict())
    state = _consolidate_cli(tmp_path / "ckpt", tmp_path / "full.pt")
    fresh = Holder()
    fresh.load_state_dict(state)  # strict
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


def test_step_root_engine_gives_the_module_names_everywhere(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Holder()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = build_engine(model, [opt], zinf.ZeroConfig(), torch.device("cpu"))
    _trained_engine(engine, lambda x: engine("forward", x))
    assert engine.name_prefix == "module."  # inside the engine every name is under the step root
    expected = engine.full_state_dict()
    fresh = Holder()
    assert set(expected) == set(fresh.state_dict())  # it leaves the engine without the root's prefix
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    _, params, buffers = _recorded_names(tmp_path / "ckpt")
    assert set(params) | set(buffers) == set(expected)
    state = consolidate(tmp_path / "ckpt")
    fresh.load_state_dict(state)  # strict
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())
    # a state dict with the module's names goes into the module as it is; one recorded under the root is stripped
    assert module_names(state, fresh) == state
    assert set(module_names({f"module.{k}": v for k, v in state.items()}, fresh)) == set(fresh.state_dict())
