"""One Fabric training run, launched by the adapter tests as a script (under torchrun, or with Fabric's
own subprocess launcher starting the ranks). Each rank writes its per-step losses to ``<out>/rank<r>.json``.

    python fabric_driver.py --strategy zero_infinity --kind gpt --steps 20 --out DIR [--clip 0.5 --accum 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models.py

from lightning.fabric import Fabric  # noqa: E402
from models import batches, build, make_optimizer  # noqa: E402

import lightning_zinf  # noqa: E402,F401  (registers "zero_infinity")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="zero_infinity")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--kind", default="gpt")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--save-at", type=int, default=0, help="fabric.save after this many steps into <out>/ckpt")
    p.add_argument("--resume", default=None, help="fabric.load this checkpoint, then train up to --steps")
    p.add_argument("--compile", action="store_true", help="hand fabric.setup a torch.compile'd model")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
                    precision=args.precision)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = build(args.kind)
    optimizer = make_optimizer(model, "adamw")
    if args.compile:
        model = torch.compile(model)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)

    losses = []
    rank, world = fabric.global_rank, fabric.world_size
    for step, (x, y) in enumerate(batches(args.kind, args.steps, 8)):
        if step < state["step"]:
            continue
        xs, ys = fabric.to_device((x.chunk(world)[rank], y.chunk(world)[rank]))
        total = 0.0
        for i, (xm, ym) in enumerate(zip(xs.chunk(args.accum), ys.chunk(args.accum))):
            with fabric.no_backward_sync(model, enabled=i < args.accum - 1):
                loss = model(xm, ym) / args.accum
                fabric.backward(loss)
            total += float(loss)
        if args.clip:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        state["step"] = step + 1
        if args.save_at and state["step"] == args.save_at:
            fabric.save(out / "ckpt", state)
    record = {"train": losses, "step": state["step"]}
    if args.compile:
        from torch._dynamo.utils import counters

        record["graphs"] = int(counters["stats"]["unique_graphs"])
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    from dist_utils import exit_cleanly

    exit_cleanly()
