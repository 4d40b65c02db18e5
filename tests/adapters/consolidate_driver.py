"""A short Lightning run on ``zero_infinity`` that leaves a checkpoint for test_consolidate_keys.py.

    python consolidate_driver.py --steps 6 --out DIR

The LightningModule holds the model as a child named ``module`` (the name the strategy's step root
gives the LightningModule, so a prefix removed twice or not at all shows), a parameter of its own and a
buffer. Written under ``DIR``: ``ckpt`` (``trainer.save_checkpoint``) and, on rank 0, ``trained.pt``: the
engine's full state dict after training (``strategy.engine.full_state_dict()``, as it is), and
``module_names.json``: the names of the LightningModule's own ``state_dict()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models.py, tests/dist_utils.py

import lightning.pytorch as pl  # noqa: E402
import lightning_zinf  # noqa: E402,F401  (registers "zero_infinity")
from models import batches, build, make_optimizer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


GLOBAL_BATCH = 8


class Wrapped(pl.LightningModule):
    """The model under ``self.module``, a scale parameter and a step counter buffer of the LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.module: nn.Module | None = None
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def configure_model(self) -> None:
        if self.module is None:
            torch.manual_seed(0)
            self.module = build("gpt")

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += 1
        return self.module(x, y) * self.scale

    def configure_optimizers(self):
        return make_optimizer(self, "adamw")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    xs, ys = zip(*batches("gpt", args.steps, GLOBAL_BATCH))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=GLOBAL_BATCH // 2, shuffle=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="zero_infinity", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Wrapped(), loader)
    trainer.save_checkpoint(out / "ckpt")
    full = trainer.strategy.engine.full_state_dict()  # collective; rank 0 gets the values
    if trainer.global_rank == 0:
        torch.save(full, out / "trained.pt")
        (out / "module_names.json").write_text(json.dumps(list(trainer.lightning_module.state_dict())))


if __name__ == "__main__":
    main()
    from dist_utils import exit_cleanly

    exit_cleanly()
