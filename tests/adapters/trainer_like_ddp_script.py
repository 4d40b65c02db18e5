"""transformers ``Trainer`` runs, written as a user would (nothing in them knows about zinf), whose result must be the
same under plain ``accelerate launch`` (DDP) and under ``zinf launch``. Launched by test_trainer_like_ddp.py:

    trainer_like_ddp_script.py OUT.json OUTPUT_DIR SCENARIO

A GPT-2 from a small config (tied embeddings, dropout off), fp32 parameters, on generated tokens. SCENARIO:

- ``evaluate_first``: ``trainer.evaluate()`` before ``trainer.train()`` (4 steps), then ``evaluate()`` again.
- ``train_evaluate``: the same without the first evaluation (under DDP, an evaluation before training leaves the
  model unwrapped: Accelerate marks it prepared, so ``train()`` runs without DDP and each rank trains alone).
- ``best_only_model``: a checkpoint and an evaluation every 2 of 6 steps with ``save_only_model=True`` and
  ``load_best_model_at_end``; the best model is the one with the *highest* evaluation loss (``greater_is_better``),
  so it is the first checkpoint's and differs from the last weights.
- ``best_only_adapter``: the same with a peft LoRA adapter on the attention (its best checkpoint is not the last).
- ``bf16``: ``bf16=True`` (mixed precision), a checkpoint at step 2 of 2, then ``trainer.save_model(OUTPUT_DIR/final)``.

Rank 0 writes the logged losses, the evaluations and the best checkpoint to OUT.json, and the final full state dict
(``accelerator.get_state_dict``, gathered on every rank) to OUT.json.pt."""

import argparse
import json
import os

import torch
from token_data import Tokens
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

BEST_ONLY = dict(max_steps=6, eval_strategy="steps", eval_steps=2, save_steps=2, save_only_model=True,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
SCENARIOS = {
    "evaluate_first": dict(max_steps=4, save_strategy="no"),
    "train_evaluate": dict(max_steps=4, save_strategy="no"),
    "best_only_model": BEST_ONLY,
    "best_only_adapter": BEST_ONLY,
    "bf16": dict(max_steps=2, save_steps=2, bf16=True),
}

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("outdir")
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if a.scenario == "best_only_adapter":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                 init_lora_weights=False))
    args = TrainingArguments(output_dir=a.outdir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
                             seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **SCENARIOS[a.scenario])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(128, 16, 128, seed=7),
                      eval_dataset=Tokens(16, 16, 128, seed=8))
    evaluations = []
    if a.scenario == "evaluate_first":
        evaluations.append(trainer.evaluate()["eval_loss"])
    trainer.train()
    if a.scenario in ("evaluate_first", "train_evaluate"):
        evaluations.append(trainer.evaluate()["eval_loss"])
    if a.scenario == "bf16":
        trainer.save_model(os.path.join(a.outdir, "final"))
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        torch.save(state, f"{a.out}.pt")
        history = trainer.state.log_history
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"losses": [h["loss"] for h in history if "loss" in h],
                       "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
                       "evaluations": evaluations, "best": trainer.state.best_model_checkpoint,
                       "world": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
