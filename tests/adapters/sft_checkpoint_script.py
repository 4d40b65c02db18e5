"""A TRL ``SFTTrainer`` + PEFT LoRA run that saves, evaluates, keeps its best adapter and resumes, written as a user
would: nothing in it knows about zinf. Launched by test_trainer_checkpoints.py under ``zinf launch``:

    python sft_checkpoint_script.py MODEL_DIR OUTPUT_DIR FINAL_DIR RESULT_JSON [--resume]

The data and LoRA settings of sft_lora_script.py (LoRA dropout on), 8 steps, Trainer's default
``save_strategy="steps"`` with a checkpoint and an evaluation every 4 steps, ``save_total_limit=2`` and
``load_best_model_at_end`` with the highest evaluation loss as the best (the first checkpoint, so the final adapter
is a middle checkpoint's). ``--resume``: ``trainer.train(resume_from_checkpoint=True)``. After training every rank
calls ``trainer.save_model(FINAL_DIR)`` and ``accelerator.get_state_dict``; rank 0 writes the logged losses to
RESULT_JSON and the LoRA weights of that state dict to RESULT_JSON.pt."""

import json
import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from sft_lora_script import texts


def main() -> None:
    model_dir, output_dir, final_dir, result = sys.argv[1:5]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = texts(80)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=output_dir, max_steps=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=1e-2, seed=0, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                     disable_tqdm=True, eval_strategy="steps", eval_steps=4, save_steps=4, save_total_limit=2,
                     load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
                     per_device_eval_batch_size=4)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": data[:64]}),
                         eval_dataset=Dataset.from_dict({"text": data[64:]}), processing_class=tokenizer,
                         peft_config=lora)
    trainer.train(resume_from_checkpoint=True if "--resume" in sys.argv else None)
    trainer.save_model(final_dir)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.is_world_process_zero():
        torch.save({k: v for k, v in state.items() if "lora_" in k}, f"{result}.pt")
        history = trainer.state.log_history
        with open(result, "w", encoding="utf-8") as f:
            json.dump({"losses": [h["loss"] for h in history if "loss" in h],
                       "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
                       "best": trainer.state.best_model_checkpoint, "world": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
