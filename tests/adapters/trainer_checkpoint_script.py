"""A transformers ``Trainer`` run that saves, evaluates, keeps its best model and resumes, written as a user would:
nothing in it knows about zinf. Launched by test_trainer_checkpoints.py under ``zinf launch``:

    trainer_checkpoint_script.py OUT.json OUTPUT_DIR FINAL_DIR [--resume]

A GPT-2 from a small config (tied embeddings, dropout on), fp32, 8 steps on generated tokens, Trainer's default
``save_strategy="steps"`` with a checkpoint and an evaluation every 2 steps, ``save_total_limit=2`` and
``load_best_model_at_end``; the best model is the one with the *highest* evaluation loss (``greater_is_better``), so
that it is the first checkpoint, a middle one that rotation keeps and the final model differs from the last
checkpoint's. ``--resume``: ``trainer.train(resume_from_checkpoint=True)`` (the last checkpoint in OUTPUT_DIR).
After training every rank calls ``trainer.save_model(FINAL_DIR)`` and ``accelerator.get_state_dict``; rank 0 writes
the logged losses and the best checkpoint to OUT.json and the state dict to OUT.json.pt."""

import argparse
import json

import torch
from token_data import Tokens
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("outdir")
    p.add_argument("final")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    args = TrainingArguments(output_dir=a.outdir, max_steps=8, per_device_train_batch_size=4, learning_rate=2e-3,
                             max_grad_norm=1.0, logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2,
                             save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=True, per_device_eval_batch_size=4, report_to=[], use_cpu=True, seed=0,
                             data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(128, 16, 128, seed=7),
                      eval_dataset=Tokens(16, 16, 128, seed=8))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    trainer.save_model(a.final)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        torch.save(state, f"{a.out}.pt")
        history = trainer.state.log_history
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"losses": [h["loss"] for h in history if "loss" in h],
                       "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
                       "best": trainer.state.best_model_checkpoint,
                       "world": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
