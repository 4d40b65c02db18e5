"""Opening a checkpoint runs no code: parts crafted (valid checksums) so that unpickling their record or client
state would create a marker file are refused by a load, ``read_client_state``, ``consolidate`` and the ``zinf
consolidate`` command, with an error naming the problem and the fix, and no marker appears. What the front ends
store comes back without any trust setting; checkpoint.allow_pickle is the one switch that reads pickles, and
``zinf upgrade-checkpoint`` converts an earlier checkpoint once. One process, real files (see
tests/crafted_checkpoints.py)."""

from __future__ import annotations

import argparse
import collections
import fractions
import math
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import zinf
from crafted_checkpoints import craft
from zinf.checkpoint import consolidate, read_client_state
from zinf.checkpoint.record import decode_record, encode_record
from zinf.cli import main as zinf_cli
from zinf.errors import CheckpointError


def _engine(allow_pickle: bool = False) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    config = zinf.ZeroConfig(checkpoint={"allow_pickle": allow_pickle})
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99)), config)


def _saved(path: Path, client_state: object = None) -> dict[str, torch.Tensor]:
    engine = _engine()
    engine.backward(engine(torch.randn(8, 16)).square().mean())
    engine.step()
    engine.save_checkpoint(str(path), client_state={"epoch": 3} if client_state is None else client_state)
    state = engine.full_state_dict()
    engine.close()
    return state


def _fresh_weights(engine: zinf.ZeroInfinityEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _consolidate_cli(ckpt: Path, out: Path, *extra: str) -> int:
    return zinf_cli(["consolidate", str(ckpt), str(out), "-q", *extra])


def test_a_client_state_that_would_run_code_is_refused_and_nothing_is_loaded(tmp_path: Path, capsys) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    saved = _saved(ckpt)
    craft(ckpt, "client", marker)
    fresh = _engine()
    before = _fresh_weights(fresh)
    with pytest.raises(CheckpointError) as err:
        fresh.load_checkpoint(str(ckpt))
    msg = str(err.value)
    for text in ("client state holds io.open", "Nothing was loaded", "add_safe_globals",
                 "checkpoint.allow_pickle=True"):
        assert text in msg, msg
    assert not marker.exists()
    # checked before anything changed: the engine keeps its weights and trains on
    assert all(torch.equal(v, before[k]) for k, v in fresh.full_state_dict().items())
    fresh.backward(fresh(torch.randn(8, 16)).square().mean())
    fresh.step()
    with pytest.raises(CheckpointError, match="holds io.open"):
        read_client_state(ckpt)
    assert not marker.exists()
    # the weights alone never need the client state: consolidate and the command read the record and tensors only
    assert all(torch.equal(v, saved[k]) for k, v in consolidate(ckpt).items())
    assert _consolidate_cli(ckpt, tmp_path / "model.pt") == 0
    assert not marker.exists()
    # the setting is the one gate: a trusted file is unpickled, and this one then runs its code
    trusting = _engine(allow_pickle=True)
    assert trusting.load_checkpoint(str(ckpt))["epoch"] == 3
    assert marker.exists()
    fresh.close()
    trusting.close()


def test_a_record_that_is_a_pickle_is_never_unpickled(tmp_path: Path, capsys) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _saved(ckpt)
    (part,) = craft(ckpt, "record", marker)
    for allow_pickle in (False, True):  # trusted or not: a current-format record is JSON or refused
        fresh = _engine(allow_pickle)
        with pytest.raises(CheckpointError) as err:
            fresh.load_checkpoint(str(ckpt))
        assert f"{part} is damaged: its record (zinf.meta) is not zinf's JSON record" in str(err.value), str(err.value)
        assert "never unpickled" in str(err.value)
        fresh.close()
    with pytest.raises(CheckpointError, match="not zinf's JSON record"):
        consolidate(ckpt, allow_pickle=True)
    capsys.readouterr()
    assert _consolidate_cli(ckpt, tmp_path / "model.pt", "--allow-pickle") == 1
    assert "not zinf's JSON record" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "model.pt").exists()


def test_an_earlier_pickled_checkpoint_is_refused_with_both_ways_to_read_it(tmp_path: Path, capsys) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    _saved(ckpt)
    craft(ckpt, "earlier", marker)
    fresh = _engine()
    with pytest.raises(CheckpointError) as err:
        fresh.load_checkpoint(str(ckpt))
    msg = str(err.value)
    for text in ("is a zinf-sharded-v2 part", "pickles, which can run any code", f"zinf upgrade-checkpoint {ckpt}'",
                 "checkpoint.allow_pickle=True", "zinf consolidate: --allow-pickle"):
        assert text in msg, msg
    capsys.readouterr()
    assert _consolidate_cli(ckpt, tmp_path / "model.pt") == 1
    assert "zinf upgrade-checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="zinf-sharded-v2"):
        read_client_state(ckpt)
    assert not marker.exists()
    fresh.close()


def test_an_earlier_checkpoint_loads_when_trusted_and_upgrades_once(tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    saved = _saved(ckpt)
    craft(ckpt, "earlier-benign", tmp_path / "unused", client_state={"epoch": 3, "ratio": fractions.Fraction(1, 3)})
    trusting = _engine(allow_pickle=True)
    assert trusting.load_checkpoint(str(ckpt)) == {"epoch": 3, "ratio": fractions.Fraction(1, 3)}
    assert trusting.global_step == 1
    trusting.close()
    assert zinf_cli(["upgrade-checkpoint", str(ckpt)]) == 0
    assert "converted 1 part(s), 0 already current" in capsys.readouterr().out
    assert zinf_cli(["upgrade-checkpoint", str(ckpt)]) == 0
    assert "converted 0 part(s), 1 already current" in capsys.readouterr().out
    # now data: the record loads untrusted; a client state type outside the allowed ones still needs the setting
    assert all(torch.equal(v, saved[k]) for k, v in consolidate(ckpt).items())
    fresh = _engine()
    with pytest.raises(CheckpointError, match="holds fractions.Fraction"):
        fresh.load_checkpoint(str(ckpt))
    assert fresh.load_checkpoint(str(ckpt), allow_pickle=True)["ratio"] == fractions.Fraction(1, 3)
    assert all(torch.equal(v, saved[k]) for k, v in fresh.full_state_dict().items())
    fresh.close()


def test_what_the_front_ends_store_round_trips_without_trust(tmp_path: Path) -> None:
    from omegaconf import DictConfig, OmegaConf

    hydra = OmegaConf.create({"model": {"lr": 0.1, "layers": [1, 2]}, "name": "x", "opt": None, "ref": "${name}"})
    client = {
        "hyper_parameters": hydra, "hparams_type": DictConfig,  # what Lightning stores for an OmegaConf config
        "args": argparse.Namespace(seed=3, layers=[1, 2]),
        "callbacks": {"ModelCheckpoint{'monitor': 'val'}": {"best_model_score": torch.tensor(0.5),
                                                          "dirpath": pathlib.Path("/runs/ckpt"),
                                                          "best_k_models": {"/runs/a.ckpt": torch.tensor(0.5)}}},
        "loops": collections.OrderedDict(fit_loop={"epoch_progress": {"total": {"ready": 2}}}),
        "lr_schedulers": [{"base_lrs": [0.1], "last_epoch": 4, "_last_lr": [0.05]}],
        "numpy": {"score": np.float64(0.25), "counts": np.arange(4, dtype=np.int32), "mask": np.array([True, False])},
        "step": 7, "nothing": None, "ratio": 0.5,
    }
    engine = _engine()
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state=client)
    engine.close()
    back = read_client_state(tmp_path / "ckpt")
    assert type(back["hyper_parameters"]) is DictConfig and back["hparams_type"] is DictConfig
    assert OmegaConf.to_container(back["hyper_parameters"], resolve=True) == {
        "model": {"lr": 0.1, "layers": [1, 2]}, "name": "x", "opt": None, "ref": "x"}
    assert vars(back["args"]) == vars(client["args"])
    assert back["callbacks"]["ModelCheckpoint{'monitor': 'val'}"]["dirpath"] == pathlib.Path("/runs/ckpt")
    assert back["loops"] == client["loops"] and back["lr_schedulers"] == client["lr_schedulers"]
    assert back["numpy"]["score"] == 0.25 and back["numpy"]["counts"].dtype == np.int32
    assert back["numpy"]["counts"].tolist() == [0, 1, 2, 3] and back["numpy"]["mask"].tolist() == [True, False]
    assert back["step"] == 7 and back["nothing"] is None


def test_the_record_is_json_with_its_tensors_stored_as_tensors() -> None:
    value = {"betas": (0.9, 0.99), "scale": math.inf, "nan": math.nan, "by_int": {1: "a", "$x": 2},
             "step": torch.tensor(5.0), "groups": [{"names": ["w"], "shape": [2, 3]}], "none": None, "flag": True}
    text, tensors = encode_record(value)
    assert list(tensors) == ["zinf.meta.00000"] and b"$tensor" in text and b"NaN" not in text
    back = decode_record(text, lambda name: tensors[name])
    assert back["betas"] == (0.9, 0.99) and back["scale"] == math.inf and math.isnan(back["nan"])
    assert back["by_int"] == {1: "a", "$x": 2} and torch.equal(back["step"], torch.tensor(5.0))
    assert back["groups"] == value["groups"] and back["none"] is None and back["flag"] is True
    with pytest.raises(CheckpointError, match=r"holds a fractions.Fraction at param_groups\[0\].ratio"):
        encode_record({"param_groups": [{"ratio": fractions.Fraction(1, 2)}]})
    for bad in (b"\x80\x04K\x01.", b'{"$tensor": "master.00000"}', b'{"$eval": 1}'):
        with pytest.raises(ValueError):
            decode_record(bad, lambda name: torch.zeros(1))


def test_the_engine_record_keeps_the_optimizer_hyper_parameters_exactly(tmp_path: Path) -> None:
    _saved(tmp_path / "ckpt")
    fresh = _engine()
    fresh.optimizer.optimizer.param_groups[0]["betas"] = (0.5, 0.5)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.optimizer.optimizer.param_groups[0]["betas"] == (0.8, 0.99)  # a tuple, as the optimizer keeps it
    fresh.close()
