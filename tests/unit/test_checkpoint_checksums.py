"""Corrupted bytes in a checkpoint tensor are an error naming the file and the tensor; nothing is loaded.
Zeroed data, a flipped exponent bit, a flipped lowest mantissa bit. One process, real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.checkpoint import consolidate
from zinf.errors import CheckpointError


def _engine() -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _corrupt(file: Path, needle: bytes, how: str) -> None:
    data = bytearray(file.read_bytes())
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the tensor's bytes must appear once in the file"
    if how == "zeroed":
        data[at : at + len(needle)] = bytes(len(needle))
    elif how == "exponent":
        data[at + 4 * 5 + 3] ^= 0x40
    else:
        data[at + 4 * 5] ^= 0x01
    file.write_bytes(data)
    os.sync()


@pytest.mark.parametrize("how", ["zeroed", "exponent", "low_bit"])
def test_a_corrupted_checkpoint_tensor_is_refused_and_nothing_is_loaded(tmp_path: Path, how: str) -> None:
    engine = _engine()
    engine.backward(engine(torch.randn(8, 32)).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    master = engine.master_of(engine.groups[1]).detach().cpu().contiguous()
    files = sorted((tmp_path / "ckpt").glob("*.pt"))
    assert len(files) == 1
    _corrupt(files[0], master.numpy().tobytes(), how)
    fresh = _engine()
    before = fresh.full_state_dict()
    with pytest.raises(CheckpointError) as err:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
    msg = str(err.value)
    assert f"{files[0]} is corrupted: tensor master[1] ({master.numel() * 4} bytes, torch.float32) has CRC32C" in msg, msg
    after = fresh.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused checkpoint changed the weights"
    with pytest.raises(CheckpointError, match="is corrupted: tensor master"):
        consolidate(tmp_path / "ckpt")
    engine.close()
    fresh.close()


def test_an_intact_checkpoint_loads(tmp_path: Path) -> None:
    engine = _engine()
    engine.save_checkpoint(str(tmp_path / "ckpt"), {"epoch": 2})
    fresh = _engine()
    assert fresh.load_checkpoint(str(tmp_path / "ckpt")) == {"epoch": 2}
    assert set(consolidate(tmp_path / "ckpt")) == set(engine.full_state_dict())


def test_a_changed_step_or_hyper_parameter_is_refused(tmp_path: Path) -> None:
    """The zip format torch writes does not check its own CRCs on load: a changed value other than a tensor
    (here written back through torch.save, as a flipped byte would read) must still be caught."""
    engine = _engine()
    engine.backward(engine(torch.randn(8, 32)).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    (file,) = sorted((tmp_path / "ckpt").glob("*.pt"))
    payload = torch.load(file, weights_only=False)
    payload["optimizer"]["param_groups"][0]["lr"] = 10.0
    torch.save(payload, file)
    with pytest.raises(CheckpointError, match="its step, hyper-parameters or layout do not match their checksum"):
        _engine().load_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
