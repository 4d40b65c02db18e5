"""A transformers ``Trainer`` full fine-tune as a user writes it (``from_pretrained``, ``Trainer``, ``train``), with
each rank's resident memory sampled; run by bench_host_memory.py under ``accelerate launch`` (DDP) and
``zinf launch``. Writes ``OUT.rank<r>.json``: the RSS growth over the process's RSS before ``from_pretrained`` at
each mark (loaded; before the engine, ``Trainer(...)`` built; each step's end: current and sampled peak so far), the
kernel's high-water mark growth, each step's wall time, and with zinf the engine's own host bytes after each step
and its host high-water mark during the step (``StepReport.peak_host_bytes``).

    trainer_memory_script.py MODEL_DIR OUT --steps N
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import Dataset
from rss import GrowthMarks, engine_figures  # this folder: the script's own
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments


class _Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    a = p.parse_args()
    sampler = GrowthMarks()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    sampler.mark("loaded")
    args = TrainingArguments(output_dir=a.out + ".trainer", max_steps=a.steps, per_device_train_batch_size=a.batch,
                             learning_rate=2e-5, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            engine = None
            try:
                from zinf.integrations.trainer import engine_of

                engine = engine_of(trainer)
            except ImportError:
                pass
            sampler.mark(f"step {state.global_step}", **engine_figures(engine))

    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(64, a.seq, model.config.vocab_size),
                      callbacks=[Marks()])
    sampler.mark("before engine")  # Trainer(...) built; the engine is built in train()
    trainer.train()
    hwm = sampler.stop()
    with open(f"{a.out}.rank{trainer.args.process_index}.json", "w", encoding="utf-8") as f:
        json.dump({"marks": sampler.marks, "hwm": hwm}, f)


if __name__ == "__main__":
    main()
