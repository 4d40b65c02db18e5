"""One training recipe, run two ways: plain single-process PyTorch (the reference) and zinf on N ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zinf
from models import batches, build, make_optimizer


@dataclass
class Recipe:
    kind: str = "gpt"
    steps: int = 30
    batch: int = 8  # global batch per optimizer step (split over ranks, then over micro-batches)
    accum: int = 1
    clip: float = 0.0
    optimizer: str = "adamw"
    zinf: dict[str, Any] = field(default_factory=dict)


def reference(recipe: Recipe) -> tuple[list[float], dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: CPU reductions round differently with more threads
    try:
        return _reference(recipe)
    finally:
        torch.set_num_threads(threads)


def _reference(recipe: Recipe) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build(recipe.kind)
    opt = make_optimizer(model, recipe.optimizer)
    losses = []
    for x, y in batches(recipe.kind, recipe.steps, recipe.batch):
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(recipe.accum), y.chunk(recipe.accum)):
            loss = model(xm, ym) / recipe.accum
            loss.backward()
            total += loss.detach().float()
        if recipe.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def zinf_worker(rank: int, world: int, recipe: Recipe) -> dict[str, Any]:
    """Each rank trains on its slice of every global batch; returns the global losses and the final weights."""
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"gradient_clipping": recipe.clip, **recipe.zinf})
    with zinf.Init(config):
        model = build(recipe.kind)
    engine = zinf.initialize(model, make_optimizer(model, recipe.optimizer), config)
    losses, skipped = [], 0
    for x, y in batches(recipe.kind, recipe.steps, recipe.batch):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        total = torch.zeros(())
        for xm, ym in zip(xs.chunk(recipe.accum), ys.chunk(recipe.accum)):
            loss = engine(xm, ym) / recipe.accum
            engine.backward(loss)
            total += loss.detach().float()
        skipped += int(not engine.step())
        dist.all_reduce(total)
        losses.append(total.item() / world)
    report = engine.report()
    result = {"losses": losses, "state": engine.full_state_dict(), "skipped": skipped,
              "report": None if report is None else report.summary(),
              "rerecords": {k: t.num_rerecords for k, t in engine.hooks.traces.items()}}
    engine.close()
    return result
