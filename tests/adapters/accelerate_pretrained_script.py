"""An Accelerate loop that starts from pretrained weights, launched by test_accelerate_pretrained.py:

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_cpu.yaml accelerate_pretrained_script.py \
        MODEL_DIR OUT_PREFIX [--zinf]

With ``--zinf`` the Accelerator is ``accelerate_zinf``'s (the one changed import) and the model is built by
``from_pretrained`` inside ``accelerator.init_module()``; without it, plain Accelerate (DDP) and a plain
``from_pretrained``. AdamW, gradient accumulation 2, clipping, a fixed per-rank data sequence. Every rank writes
``OUT_PREFIX.rank<r>.json``: the per-step global mean losses, its resident share of the model's parameter bytes
right after construction, and zinf's load summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/models.py, dist_utils.py
from models import token_batches  # noqa: E402
from pretrained_probe import LoadLog, resident_share  # noqa: E402

STEPS = 6  # optimizer steps
ACCUM = 2
PER_RANK = 2  # sequences per rank per micro-batch
LR = 2e-3
CLIP = 0.5  # below the gradient norm of the first steps: clipping acts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--zinf", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.zinf:
        from accelerate_zinf import Accelerator
    else:
        from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
    load_log = LoadLog()
    with accelerator.init_module() if args.zinf else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    share = resident_share(model)
    vocab = model.config.vocab_size
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)

    world, rank = accelerator.num_processes, accelerator.process_index
    micro = [b.chunk(world)[rank] for b in token_batches(STEPS * ACCUM, PER_RANK * world, vocab=vocab)]
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for x in micro[step * ACCUM:(step + 1) * ACCUM]:
            with accelerator.accumulate(model):
                loss = model(input_ids=x, labels=x).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach()
        losses.append(accelerator.reduce(total / ACCUM, reduction="mean").item())
    load_log.close()
    record = {"losses": losses, "grad_norms": norms, "world": world, "resident_share": share, "loads": load_log.loads,
              "accelerator": f"{type(accelerator).__module__}.{type(accelerator).__name__}"}
    with open(f"{args.out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(record, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    from dist_utils import exit_cleanly

    exit_cleanly()  # without the interpreter's teardown, where torch 2.13's gloo can abort a finished run
