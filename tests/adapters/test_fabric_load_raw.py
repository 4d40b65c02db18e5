"""Fabric's ``load_raw`` and Lightning settings the engine cannot honour, one rank in process.

With one rank zinf is bit-identical to plain training, so a run is compared with the same run under Fabric's
"ddp" strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_zinf  # noqa: F401  (registers "zero_infinity")


@pytest.fixture(autouse=True)
def _no_process_group_after() -> Iterator[None]:
    """Fabric and the Trainer leave their one-rank process group initialized: later tests in this process start
    without one."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _raw(tmp_path: Path) -> Path:
    """An ordinary ``torch.save(model.state_dict())`` of other weights than the model's initial ones."""
    path = tmp_path / "raw.pt"
    if not path.exists():
        net = _net()
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(3.0)
        torch.save(net.state_dict(), path)
    return path


def _losses_after_load_raw(strategy: str, raw: Path) -> list[float]:
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    with fabric.init_module():
        model = _net()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load_raw(raw, model)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fabric_load_raw_loads_a_plain_state_dict_into_the_shards(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    ours = _losses_after_load_raw("zero_infinity", raw)
    assert ours == _losses_after_load_raw("ddp", raw)
    assert ours[0] != _losses_after_load_raw("zero_infinity", _other(tmp_path))[0]  # the file's weights were used


def _other(tmp_path: Path) -> Path:
    path = tmp_path / "init.pt"
    torch.save(_net().state_dict(), path)
    return path


def test_fabric_load_raw_of_an_optimizer_names_the_directory_load(tmp_path: Path) -> None:
    fabric = L.Fabric(strategy="zero_infinity", accelerator="cpu", devices=1)
    fabric.launch()
    with fabric.init_module():
        model = _net()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(TypeError, match=r"fabric.load\(directory, state\)"):
        fabric.load_raw(_raw(tmp_path), opt)


class _WithBatchNorm(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_sync_batchnorm_is_refused_naming_the_fix() -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 3, (8,))),
                                       batch_size=4)
    trainer = L.Trainer(strategy="zero_infinity", accelerator="cpu", devices=1, max_steps=1, sync_batchnorm=True,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(MisconfigurationException, match="sync_batchnorm"):
        trainer.fit(_WithBatchNorm(), data)
