"""A QLoRA fine-tuning run as the peft documentation writes it: a 4-bit NF4 base (bitsandbytes, double
quantization, fp32 compute), ``prepare_model_for_kbit_training``, LoRA adapters, transformers' ``Trainer``. Nothing
in it knows about zinf.

Launched by test_qlora.py under plain ``accelerate launch`` (DDP, bitsandbytes' ``Linear4bit`` on the CPU) and
under ``zinf launch``:

    python qlora_script.py MODEL_DIR OUTPUT_DIR RESULT_JSON [nf4|int8]

``int8``: the base in bitsandbytes' 8 bits (``load_in_8bit``) instead, the rest unchanged.

Rank 0 writes the logged per-step losses, the trainable / total parameter counts, the next-token logits of a prompt
with the adapter and without it, and the saved adapter's file names to ``RESULT_JSON``. Trainer saves its
checkpoints every 3 steps (``OUTPUT_DIR/checkpoint-3``, ``checkpoint-6``).
"""

import json
import os
import sys

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, DataCollatorForLanguageModeling,
                          Trainer, TrainingArguments, set_seed)

from sft_lora_script import probe, texts


def quantization(kind: str = "nf4") -> BitsAndBytesConfig:
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def main() -> None:
    model_dir, output_dir, result = sys.argv[1], sys.argv[2], sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "nf4"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quantization(kind))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # non-reentrant checkpointing: what DDP needs with a PeftModel (peft's multi-GPU QLoRA setting)
    model = prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    set_seed(0)  # the adapters' initial values
    model = get_peft_model(model, lora)
    dataset = [tokenizer(t) for t in texts(64)]
    args = TrainingArguments(output_dir=output_dir, max_steps=6, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, seed=0, logging_steps=1,
                             report_to="none", use_cpu=True, disable_tqdm=True, save_steps=3)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "adapter"))

    looked = probe(model, tokenizer)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(result, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "accelerator": type(trainer.accelerator).__module__,
                       "world": trainer.accelerator.num_processes, **looked,
                       "adapter": sorted(os.listdir(os.path.join(output_dir, "adapter")))}, f)


if __name__ == "__main__":
    main()
