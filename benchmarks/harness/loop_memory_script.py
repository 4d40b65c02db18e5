"""A full fine-tune from ``from_pretrained`` as users write it in an Accelerate training loop or a Lightning module,
with each rank's resident memory sampled; run by bench_host_memory.py (Accelerate: under ``accelerate launch`` for DDP
and ``zinf launch`` for zinf; Lightning: with ``strategy="ddp"`` or ``ZeroInfinityStrategy`` and the ``zinf:``
section of ``--zinf-config``). Writes ``OUT.rank<r>.json`` with the same marks as trainer_memory_script.py: the RSS
growth over the process's RSS before ``from_pretrained`` when loaded, just before the engine (or DDP) is built, and at
each step's end (current and sampled peak so far), the kernel's high-water mark growth, and with zinf the engine's
own host bytes after each step and its host high-water mark during the step.

``datasets`` is imported with the script, as the ``Trainer`` script's ``from transformers import Trainer`` does:
otherwise Accelerate's ``prepare`` imports it (and pandas and pyarrow with it, about 80 MiB a process under DDP and
zinf alike) after the base is taken, and that import would be counted as the growth of loading and training.

    loop_memory_script.py MODEL_DIR OUT --front-end accelerate|lightning --steps N [--batch B] [--zinf-config FILE]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import datasets  # noqa: F401  (see the docstring)
import torch
from rss import GrowthMarks, engine_figures  # this folder: the script's own
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

SEQ = 32


def _tokens(vocab: int) -> TensorDataset:
    return TensorDataset(torch.randint(0, vocab, (64, SEQ), generator=torch.Generator().manual_seed(0)))


def _write(out: str, rank: int, marks: GrowthMarks, hwm: int) -> None:
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"marks": marks.marks, "hwm": hwm}, f)


def accelerate_loop(a: argparse.Namespace) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator()
    marks = GrowthMarks()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    marks.mark("loaded")
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    loader = DataLoader(_tokens(model.config.vocab_size), batch_size=a.batch)
    marks.mark("before engine")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, (ids,) in enumerate(loader, start=1):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        marks.mark(f"step {step}", **engine_figures(getattr(model, "engine", None)))
        if step == a.steps:
            break
    _write(a.out, accelerator.process_index, marks, marks.stop())


def lightning_fit(a: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import yaml

    import lightning_zinf

    marks: list[GrowthMarks] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is None:
                marks.append(GrowthMarks())
                self.model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
                marks[0].mark("loaded")
                marks[0].mark("before engine")

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=2e-5)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_tokens(self.model.config.vocab_size), batch_size=a.batch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            engine = getattr(self.trainer.strategy, "engine", None)
            marks[0].mark(f"step {self.trainer.global_step}", **engine_figures(engine))

    if a.zinf_config:
        with open(a.zinf_config, encoding="utf-8") as f:
            strategy: Any = lightning_zinf.ZeroInfinityStrategy(yaml.safe_load(f)["zinf"])
    else:
        strategy = "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=a.steps, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module())
    _write(a.out, trainer.global_rank, marks[0], marks[0].stop())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--front-end", choices=("accelerate", "lightning"), required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--zinf-config", default=None, help="Lightning: the engine's settings, this file's `zinf:` section")
    a = p.parse_args()
    (accelerate_loop if a.front_end == "accelerate" else lightning_fit)(a)


if __name__ == "__main__":
    main()
