"""A transformers ``Trainer`` run with ``TrainingArguments(torch_compile=True)``, written as a user would: nothing in it
knows about zinf. Launched by test_trainer_compile.py under ``zinf launch`` and under ``accelerate launch`` (DDP):

    trainer_compile_script.py OUT.json OUTPUT_DIR

A GPT-2 from a small config (dropout off, so that both launches compute the same losses), fp32, 6 steps on generated
tokens. Every rank writes OUT.json.<rank>: the logged losses and how many graphs dynamo compiled in this process."""

import argparse
import json

import torch
from token_data import Tokens
from torch._dynamo.utils import counters
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("outdir")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=a.outdir, max_steps=6, per_device_train_batch_size=4, learning_rate=2e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, torch_compile=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 16, 128, seed=7))
    trainer.train()
    with open(f"{a.out}.{trainer.args.process_index}", "w", encoding="utf-8") as f:
        json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "graphs": int(counters["stats"]["unique_graphs"]), "world": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
