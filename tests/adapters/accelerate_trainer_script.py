"""A transformers Trainer run, unchanged: a tiny Llama from a config on generated tokens. Launched by
test_accelerate.py under plain ``accelerate launch`` (DDP) and under ``zinf launch``; writes the
logged per-step losses (rank 0) to the JSON file named by the first argument.

    accelerate_trainer_script.py OUT.json OUTPUT_DIR [SAVE_DIR] [--pretrained MODEL_DIR]

``--pretrained``: the script builds the model itself with ``from_pretrained(MODEL_DIR)`` (test_trainer_pretrained.py),
and every rank also writes ``OUT.json.rank<r>.json``: its resident share of the model's parameter bytes right after
``from_pretrained`` and again once ``Trainer`` is built, and zinf's load summary (see pretrained_probe.py)."""

import argparse
import json

import torch
from token_data import Tokens
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("outdir")
    p.add_argument("save", nargs="?", default=None)
    p.add_argument("--pretrained", default=None)
    a = p.parse_args()
    out, outdir = a.out, a.outdir
    torch.manual_seed(0)
    probe = None
    if a.pretrained:
        from pretrained_probe import LoadLog, resident_share

        load_log = LoadLog()
        model = AutoModelForCausalLM.from_pretrained(a.pretrained, dtype=torch.float32)
        load_log.close()
        probe = {"resident_share": resident_share(model), "loads": load_log.loads}
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    cfg = model.config
    args = TrainingArguments(output_dir=outdir, max_steps=10, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256, 16, cfg.vocab_size))
    if probe is not None:  # Trainer has moved the model to args.device (cpu:0 under a launcher)
        probe["resident_share_in_trainer"] = resident_share(model)
    trainer.train()
    if a.save:  # what a DDP-era script does next: save on the main process
        trainer.save_model(a.save)
    if probe is not None:
        with open(f"{out}.rank{trainer.args.process_index}.json", "w", encoding="utf-8") as f:
            json.dump(probe, f)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "accelerator": type(trainer.accelerator).__module__}, f)


if __name__ == "__main__":
    main()
