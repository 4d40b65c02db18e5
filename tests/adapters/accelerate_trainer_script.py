"""A transformers Trainer run, unchanged: a tiny Llama from a config on generated tokens. Launched by
test_accelerate.py under plain ``accelerate launch`` (DDP) and under ``zinf launch``; writes the
logged per-step losses (rank 0) to the JSON file named by the first argument."""

import json
import sys

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(Dataset):
    def __init__(self, n: int, block: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(7)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.seq = (start + stride * torch.arange(block)) % vocab

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.seq[i], "labels": self.seq[i]}


def main() -> None:
    out, outdir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    args = TrainingArguments(output_dir=outdir, max_steps=10, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256, 16, cfg.vocab_size))
    trainer.train()
    if len(sys.argv) > 3:  # what a DDP-era script does next: save on the main process
        trainer.save_model(sys.argv[3])
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "accelerator": type(trainer.accelerator).__module__}, f)


if __name__ == "__main__":
    main()
