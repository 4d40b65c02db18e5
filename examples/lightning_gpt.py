"""Train a small GPT with Lightning and zinf (ZeRO-Infinity) on synthetic data.

    python examples/lightning_gpt.py                                 # 2 CPU ranks, fp32, 50 steps
    python examples/lightning_gpt.py --precision bf16-mixed --steps 100
    python examples/lightning_gpt.py --accelerator cuda --devices 4 --n-layer 12 --n-embd 768

The model is built in ``configure_model``, which the strategy runs under ``zinf.Init``: every
module is split across the ranks as soon as it is constructed, so no rank ever holds the whole
model. At the end the sharded checkpoint is turned into an ordinary single-file checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_zinf  # registers strategy="zero_infinity"

sys.path.insert(0, str(Path(__file__).parent))
from gpt import GPT, GPTConfig  # noqa: E402  (the same model as examples/train_gpt.py)


class CopyTask(Dataset):
    """Synthetic sequences whose second half repeats the first: learnable, so the loss visibly drops."""

    def __init__(self, cfg: GPTConfig, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(0, cfg.vocab, (size, (cfg.block + 1) // 2 + 1), generator=g)
        self.data = torch.cat([half, half], dim=1)[:, : cfg.block + 1]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class LitGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float = 3e-3, warmup: int = 10) -> None:
        super().__init__()
        self.cfg, self.lr, self.warmup = cfg, lr, warmup
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:  # runs under zinf.Init: partitioned while it is built
            self.gpt = GPT(self.cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true or 16-mixed (CUDA)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--out", default="lightning_gpt_out")
    args = p.parse_args()

    pl.seed_everything(0)
    cfg = GPTConfig(vocab=96, block=32, n_embd=args.n_embd, n_head=4, n_layer=args.n_layer)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy="zero_infinity", precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        val_check_interval=min(25, args.steps), limit_val_batches=4, default_root_dir=args.out,
        enable_checkpointing=False, logger=False,
    )
    model = LitGPT(cfg)
    train = DataLoader(CopyTask(cfg, 4096), batch_size=args.batch_size)
    val = DataLoader(CopyTask(cfg, 256, seed=1), batch_size=args.batch_size)
    trainer.fit(model, train, val)

    ckpt = Path(args.out) / "final.ckpt"
    trainer.save_checkpoint(ckpt)  # a directory: one shard file per rank
    if trainer.is_global_zero:
        lightning_zinf.convert_to_lightning_checkpoint(ckpt, Path(args.out) / "final-consolidated.ckpt")
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"done: {trainer.global_step} steps, {metrics}; checkpoint {ckpt} (+ final-consolidated.ckpt)")


if __name__ == "__main__":
    main()
