"""A TRL ``SFTTrainer`` + PEFT LoRA fine-tuning run, written as a user would: nothing in it knows about zinf.

Launched by test_trl_peft.py under plain ``accelerate launch`` (DDP) and under ``zinf launch``:

    python sft_lora_script.py MODEL_DIR OUTPUT_DIR RESULT_JSON

``MODEL_DIR`` holds a causal LM and its tokenizer (``save_pretrained``). After training, every rank looks at
what it trained as a user would: the next-token logits of a prompt with the adapter and without it
(``disable_adapter``), the trainable / total parameter counts, and a greedy ``generate`` of its share of
the prompts (each rank completes a different one). Rank 0 writes them, with the logged per-step losses
and every rank's completion, to ``RESULT_JSON``.

Saving is Trainer's default (``save_strategy="steps"``): a checkpoint is written when training ends (at
``max_steps``, whatever ``save_steps`` is), ``OUTPUT_DIR/checkpoint-8``.
"""

import json
import sys

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

WORDS = ("the cat sat on a mat and the dog ran to the red ball while a bird sang in the tall green tree "
         "near an old house by the quiet river").split()
PROMPTS = ["the cat sat on", "a bird sang in the tall green tree near an old"]


def texts(n: int) -> list[str]:
    """Short sentences of different lengths (so batches are padded), the same on every rank."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 13, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (length,), generator=g)
        out.append(" ".join(WORDS[i] for i in idx.tolist()))
    return out


def probe(model, tokenizer) -> dict:
    """What the adapter did, as a user looks at it: the next-token logits of the first prompt with the adapter and
    without it (``disable_adapter``), and the trainable / total parameter counts."""
    model.eval()
    prompt = tokenizer(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        tuned = model(**prompt).logits[0, -1]
        with model.disable_adapter():
            base = model(**prompt).logits[0, -1]
    trainable, total = model.get_nb_trainable_parameters()
    return {"tuned_logits": tuned.tolist(), "base_logits": base.tolist(), "trainable": trainable, "total": total}


def main(**load: object) -> None:
    """``load``: more keyword arguments of ``from_pretrained`` (sft_qlora_script.py's 4-bit base)."""
    model_dir, output_dir, result = sys.argv[1], sys.argv[2], sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"text": texts(64)})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=output_dir, max_steps=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=1e-2, seed=0, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    trainer.train()

    model = trainer.model  # the PeftModel
    looked = probe(model, tokenizer)
    with trainer.accelerator.split_between_processes(PROMPTS) as mine, torch.no_grad():
        completions = model.generate(**tokenizer(mine, return_tensors="pt"), max_new_tokens=8, do_sample=False)
    generated = gather_object(completions.tolist())
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(result, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "accelerator": type(trainer.accelerator).__module__,
                       "world": trainer.accelerator.num_processes, "generated": generated, **looked}, f)


if __name__ == "__main__":
    main()
