"""An ordinary Accelerate training loop: a small GPT on generated token sequences.

Nothing in it knows about zinf. The same file runs as plain DDP or on zinf:

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/accelerate_cpu.yaml examples/accelerate/train.py
    zinf launch --config examples/accelerate/zinf_cpu.yaml examples/accelerate/train.py --steps 40

Options: gradient accumulation (--grad-accum), clipping (--clip), a state checkpoint (--save-state DIR
[--save-at N]) and resuming from one (--resume DIR), an exported model (--save-model DIR), and the
per-step global mean losses as JSON (--losses-out FILE).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpt import GPT, GPTConfig  # noqa: E402


class Progress:
    """Optimizer steps taken; registered for checkpointing so a resumed run knows where it is."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--save-state", default=None, help="save_state into this directory (at --save-at, or the end)")
    p.add_argument("--save-at", type=int, default=0, help="stop after this many steps and save the state")
    p.add_argument("--resume", default=None, help="load_state from this directory first")
    p.add_argument("--save-model", default=None, help="save_model (safetensors) into this directory at the end")
    p.add_argument("--losses-out", default=None, help="write the per-step mean losses (JSON) here")
    return p.parse_args(argv)


def make_data(cfg: GPTConfig, n: int) -> TensorDataset:
    """Sequences with a rule to learn: each token is the previous one plus a per-sequence stride."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, cfg.vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.block + 1)) % cfg.vocab
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main(accelerator_cls: type = Accelerator, argv: list[str] | None = None) -> list[float]:
    args = parse_args(argv)
    accelerator = accelerator_cls(gradient_accumulation_steps=args.grad_accum)
    set_seed(0)
    cfg = GPTConfig(vocab=args.vocab, block=args.block, n_embd=args.width, n_head=4, n_layer=args.layers)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    per_step = args.batch * args.grad_accum * accelerator.num_processes
    loader = DataLoader(make_data(cfg, per_step * args.steps), batch_size=args.batch, shuffle=False)
    horizon = args.steps * accelerator.num_processes  # a prepared scheduler steps once per process per optimizer step
    warmup = max(1, horizon // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, horizon) / horizon)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)
    batches = iter(accelerator.skip_first_batches(loader, progress.step * args.grad_accum) if progress.step else loader)

    stop = args.save_at or args.steps
    losses: list[float] = []
    start = time.perf_counter()
    while progress.step < stop:
        total = torch.zeros((), device=accelerator.device)
        for _ in range(args.grad_accum):
            idx, targets = next(batches)
            with accelerator.accumulate(model):
                loss = model(idx, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach().float()
        mean = accelerator.reduce(total / args.grad_accum, reduction="mean").item()
        losses.append(mean)
        progress.step += 1
        if accelerator.is_main_process and (progress.step % 5 == 0 or progress.step == stop):
            accelerator.print(f"step {progress.step}/{args.steps} loss {mean:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                              f"({time.perf_counter() - start:.1f} s)")
    if args.save_state:
        accelerator.save_state(args.save_state)
    if args.save_model:
        accelerator.save_model(model, args.save_model)
    if args.losses_out and accelerator.is_main_process:
        with open(args.losses_out, "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "world": accelerator.num_processes,
                       "accelerator": type(accelerator).__module__ + "." + type(accelerator).__name__}, f)
    accelerator.end_training()
    return losses


if __name__ == "__main__":
    main()
