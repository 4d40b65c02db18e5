"""The strategies also work with the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.

One rank, in process: zinf with one rank is bit-identical to plain training, so each run is compared
with the same run without zinf (the Trainer against its "ddp" strategy, which uses the same distributed
sampler; "auto" would order the batches differently).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")
lf = pytest.importorskip("lightning_fabric")

import lightning_zinf  # noqa: E402,F401  (registers the names in both standalone packages too)

STEPS = 6


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(STEPS * 4, 8, generator=g), torch.randint(0, 3, (STEPS * 4,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(strategy: str) -> list[float]:
    model = Net()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data())
    return model.losses


def test_pytorch_lightning_trainer() -> None:
    from lightning_zinf._standalone_strategy import ZeroInfinityStrategy

    plain = _fit("ddp")
    model = Net()
    trainer = pl.Trainer(strategy="zero_infinity", accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, ZeroInfinityStrategy) and isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    trainer.fit(model, _data())
    assert len(model.losses) == STEPS and model.losses == plain


def _fabric_losses(strategy: str) -> list[float]:
    fabric = lf.Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    losses = []
    for x, y in _data():
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lightning_fabric() -> None:
    assert _fabric_losses("zero_infinity") == _fabric_losses("auto")
