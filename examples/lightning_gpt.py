"""Train a small GPT with Lightning and zinf (ZeRO-Infinity) on synthetic data.

    python examples/lightning_gpt.py                                 # 2 CPU ranks, fp32, 100 steps (~1 min)
    python examples/lightning_gpt.py --precision bf16-mixed --steps 200
    python examples/lightning_gpt.py --accelerator cuda --devices 4 --n-layer 12 --n-embd 768

The model is built in ``configure_model``, which the strategy runs under ``zinf.Init``: every
module is split across the ranks as soon as it is constructed, so no rank ever holds the whole
model. The data is generated (``StrideTask``) and has a rule to learn, so the training loss falls
from about ln(96) = 4.6 to about 1 within the default 100 steps. At the end the sharded checkpoint is
turned into an ordinary single-file checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

import lightning_zinf  # registers strategy="zero_infinity"

sys.path.insert(0, str(Path(__file__).parent))
from gpt import GPT, GPTConfig  # noqa: E402  (the same model as examples/train_gpt.py)

# Lightning 2.6 builds its batch iterator with torch.utils._pytree.LeafSpec, which recent torch deprecates: a
# FutureWarning from inside Lightning on every rank, which neither this script nor zinf can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


class StrideTask(Dataset):
    """Synthetic sequences with a rule to learn: each token is the previous one plus a per-sequence stride
    (modulo the vocabulary). Every token after the second is predictable, so the loss falls from the first
    steps on (sequences that repeat their first half, an induction task, sit at ln(vocab) for ~150 steps)."""

    def __init__(self, cfg: GPTConfig, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, cfg.vocab, (size, 1), generator=g)
        stride = torch.randint(1, 8, (size, 1), generator=g)
        self.data = (start + stride * torch.arange(cfg.block + 1)) % cfg.vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


CopyTask = StrideTask  # the name examples/hydra/train.py imports


class LitGPT(pl.LightningModule):
    """The GPT, its optimizer and its data: ``StrideTask`` loaders of ``batch_size`` sequences per rank
    (``trainer.fit(model, train_loader)`` replaces the training data; the validation data stays defined, so
    ``limit_val_batches=0`` skips validation without Lightning warning about a missing val_dataloader)."""

    def __init__(self, cfg: GPTConfig, lr: float = 6e-3, warmup: int = 10, batch_size: int = 8) -> None:
        super().__init__()
        self.cfg, self.lr, self.warmup, self.batch_size = cfg, lr, warmup, batch_size
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

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StrideTask(self.cfg, 4096), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(StrideTask(self.cfg, 256, seed=1), batch_size=self.batch_size)


class PrintLoss(pl.Callback):
    """Rank 0 prints the training loss (mean over the ranks) every ``every`` optimizer steps, and each
    validation loss."""

    def __init__(self, every: int) -> None:
        self.every, self.first, self.last = every, None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, loss = trainer.global_step, float(trainer.callback_metrics["train_loss"])
        if self.first is None:
            self.first = loss
        if step != self.last and (step == 1 or step % self.every == 0):  # once per step (--accumulate)
            self.last = step
            rank_zero_info(f"step {step:4d}: train_loss {loss:.3f}")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            loss = float(trainer.callback_metrics["val_loss"])
            rank_zero_info(f"step {trainer.global_step:4d}: val_loss   {loss:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true or 16-mixed (CUDA)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--out", default="lightning_gpt_out")
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)
    printer = PrintLoss(every=25)
    cfg = GPTConfig(vocab=96, block=32, n_embd=args.n_embd, n_head=4, n_layer=args.n_layer)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy="zero_infinity", precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        val_check_interval=min(25, args.steps), limit_val_batches=4, default_root_dir=args.out,
        enable_checkpointing=False, logger=False, enable_progress_bar=False, callbacks=[printer],
    )
    model = LitGPT(cfg, lr=args.lr, batch_size=args.batch_size)
    trainer.fit(model)

    ckpt = Path(args.out) / "final.ckpt"
    trainer.save_checkpoint(ckpt, weights_only=False)  # a directory: one shard file per rank, resumable
    if trainer.is_global_zero:
        lightning_zinf.convert_to_lightning_checkpoint(ckpt, Path(args.out) / "final-consolidated.ckpt")
        train, val = (float(trainer.callback_metrics[k]) for k in ("train_loss", "val_loss"))
        print(f"done: {trainer.global_step} steps, train_loss {printer.first:.3f} -> {train:.3f}, val_loss {val:.3f}; "
              f"checkpoint {ckpt} (+ final-consolidated.ckpt)")


if __name__ == "__main__":
    main()
