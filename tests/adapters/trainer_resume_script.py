"""A transformers ``Trainer`` run written as a user would (nothing in it knows about zinf), run on zinf by
test_safe_checkpoints.py as ``python -m accelerate_zinf.run``:

    trainer_resume_script.py OUT.json OUTPUT_DIR save                 2 steps, a checkpoint at step 2
    trainer_resume_script.py OUT.json OUTPUT_DIR resume CHECKPOINT    resume from OUTPUT_DIR/CHECKPOINT to step 4

OUT.json gets ``{"steps": global_step}``, or ``{"error": message}`` when resuming raised a zinf error."""

import json
import sys

import torch
from token_data import Tokens
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zinf.errors import ZinfError


def main() -> None:
    out, outdir, mode = sys.argv[1:4]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=outdir, max_steps=2 if mode == "save" else 4, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_steps=2, save_strategy="steps", report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32, 16, 64, seed=7))
    try:
        trainer.train(resume_from_checkpoint=f"{outdir}/{sys.argv[4]}" if mode == "resume" else None)
        result = {"steps": trainer.state.global_step}
    except ZinfError as exc:
        result = {"error": str(exc)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
