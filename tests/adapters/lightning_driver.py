"""One Lightning Trainer run, launched by the adapter tests as a script (under torchrun, or with
Lightning's own subprocess launcher starting the ranks). Each rank writes what it saw to ``<out>/rank<r>.json``.

    python lightning_driver.py --strategy zero_infinity --kind gpt --steps 20 --out DIR [--accum 2 --clip 1.0]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models.py

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from models import batches, build, make_optimizer  # noqa: E402
from pretrained_probe import LoadLog, resident_share  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_zinf  # noqa: E402,F401  (registers "zero_infinity")

GLOBAL_BATCH = 8


class LitModel(pl.LightningModule):
    def __init__(self, kind: str, build_in: str, manual: bool = False, clip: float = 0.0, accum: int = 1,
                 pretrained: str | None = None, compile: bool = False) -> None:
        super().__init__()
        self.compile_model = compile  # configure_model: self.model = torch.compile(self.model), as users write it
        self.kind, self.build_in = kind, build_in
        self.automatic_optimization = not manual
        self.clip, self.accum = clip, accum
        self.pretrained = pretrained  # a save_pretrained directory: configure_model calls from_pretrained
        self.probe: dict = {}
        self.model = None
        if build_in == "init":
            torch.manual_seed(0)
            self.model = build(kind)

    def configure_model(self) -> None:
        self._build()
        if self.compile_model and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def _build(self) -> None:
        if self.model is not None:
            return
        if self.pretrained:
            from transformers import AutoModelForCausalLM

            load_log = LoadLog()
            self.model = AutoModelForCausalLM.from_pretrained(self.pretrained, dtype=torch.float32)
            load_log.close()
            self.probe = {"loads": load_log.loads}  # the resident share in configure_optimizers: see there
        else:
            torch.manual_seed(0)
            self.model = build(self.kind)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.pretrained:
            return self.model(input_ids=x, labels=y).loss
        return self.model(x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self(x, y)
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.accum)
        if (batch_idx + 1) % self.accum == 0:
            if self.clip:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch, batch_idx):
        return self(*batch).float()

    step_every = 1  # >1: the optimizer_step override of Lightning's docs, stepping every n-th batch only

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % self.step_every == 0:
            optimizer.step(closure=optimizer_closure)
        else:  # the batch's gradients are made, then zeroed by Lightning through the optimizer it holds
            optimizer_closure()

    def configure_optimizers(self):
        if self.pretrained and "resident_share" not in self.probe:
            # after configure_model, before the engine; not inside configure_model, where zinf.Init would gather
            # every parameter the probe touches (as it does for any initialisation code there)
            self.probe["resident_share"] = resident_share(self.model)
        opt = make_optimizer(self.model, "adamw")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(Callback):
    """Per-rank losses of every training micro-batch, validation batch and test batch, in order."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, list] = {"train": [], "val": [], "test": [], "predict": [], "lr": [], "step": []}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.data["train"].append(float(outputs["loss"]))
        self.data["step"].append(trainer.global_step)
        self.data["lr"].append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.data["val"].append(float(outputs))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.data["test"].append(float(outputs))

    def write(self, rank: int, **extra) -> None:
        (self.out / f"rank{rank}.json").write_text(json.dumps({**self.data, **extra}))


def loader(kind: str, steps: int, per_rank_batch: int, seed: int = 1234) -> DataLoader:
    xs, ys = zip(*batches(kind, steps, GLOBAL_BATCH, seed=seed))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=per_rank_batch, shuffle=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="zero_infinity")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--kind", default="gpt")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=20, help="max_steps (optimizer steps)")
    p.add_argument("--epoch-steps", type=int, default=10, help="optimizer steps per epoch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--step-every", type=int, default=1, help="optimizer_step override: step every n-th batch only")
    p.add_argument("--build-in", default="configure_model", choices=["configure_model", "init", "init_module"])
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every n train steps into <out>/ckpt")
    p.add_argument("--resume", default=None)
    p.add_argument("--eval", action="store_true", help="also run validation each epoch, test and predict")
    p.add_argument("--zinf-config", default=None, help="engine settings (JSON) for ZeroInfinityStrategy(config=...)")
    p.add_argument("--pretrained", default=None, help="configure_model: from_pretrained(this directory) (--kind llama)")
    p.add_argument("--compile", action="store_true", help="configure_model compiles the model it trains")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack (hang diagnosis)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the same CPU reduction order in every run

    per_rank = GLOBAL_BATCH // args.devices // args.accum
    record = Record(out)
    callbacks: list[Callback] = [record]
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1,
                                         filename="{step}"))
    strategy = args.strategy
    if args.zinf_config:
        strategy = lightning_zinf.ZeroInfinityStrategy(config=json.loads(args.zinf_config))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=1 if args.manual else args.accum,
        gradient_clip_val=None if (args.manual or not args.clip) else args.clip,
        logger=False, enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
        limit_val_batches=2 if args.eval else 0, deterministic=False,
    )
    if args.build_in == "init_module":
        with trainer.init_module():
            model = LitModel(args.kind, "init", manual=args.manual, clip=args.clip, accum=args.accum,
                             compile=args.compile)
    else:
        model = LitModel(args.kind, args.build_in, manual=args.manual, clip=args.clip, accum=args.accum,
                         pretrained=args.pretrained, compile=args.compile)
    model.step_every = args.step_every
    train = loader(args.kind, args.epoch_steps, per_rank)
    val = loader(args.kind, 2, GLOBAL_BATCH // args.devices, seed=99)
    trainer.fit(model, train, val if args.eval else None, ckpt_path=args.resume)
    extra = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
             "train_loss": float(trainer.callback_metrics["train_loss"])}
    if args.eval:
        extra["test_loss"] = trainer.test(model, val, verbose=False)[0]["test_loss"]
        extra["predict"] = [float(x) for x in trainer.predict(model, val)]
    extra.update(model.probe)
    if args.compile:
        from torch._dynamo.utils import counters

        extra["graphs"] = int(counters["stats"]["unique_graphs"])
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:  # what the engine settings turned on
        extra["checkpointed_blocks"] = len(engine.checkpointing.blocks) if engine.checkpointing is not None else 0
        extra["tiled_layers"] = sum(type(m).__name__ == "TiledLinear" for m in engine.module.modules())
    record.write(trainer.global_rank, **extra)
    if args.strategy == "zero_infinity" and trainer.global_rank == 0 and args.ckpt_every:
        last = sorted((out / "ckpt").iterdir())[-1]
        lightning_zinf.convert_to_lightning_checkpoint(last, out / "converted.ckpt")


if __name__ == "__main__":
    main()
    from dist_utils import exit_cleanly

    exit_cleanly()
