"""One training recipe, run two ways: plain single-process PyTorch (the reference) and zinf on N ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zinf
from models import batches, build, make_optimizer
from zinf.update.loss_scale import DynamicLossScaler


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


def mixed_reference(recipe: Recipe, world: int) -> tuple[list[float], int]:
    """Plain PyTorch following zinf's mixed-precision contract, ``world`` ranks simulated in one process: fp32
    master weights stepped by the torch optimizer; each step computes with a copy of them rounded to the
    parameters' storage dtype (``param_storage``, else the ``precision``) and held in the compute dtype
    (``precision``); every rank's micro-batch gradients are summed in fp32 and averaged over
    the ranks; with fp16 the loss is scaled and a step whose gradients hold an inf or a nan anywhere is skipped
    (the scale backs off) as zinf.update.loss_scale does. Returns the global losses and the skipped steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mixed_reference(recipe, world)
    finally:
        torch.set_num_threads(threads)


def _mixed_reference(recipe: Recipe, world: int) -> tuple[list[float], int]:
    config = zinf.ZeroConfig.from_dict({"gradient_clipping": recipe.clip, **recipe.zinf})
    dtype, storage = config.compute_dtype, config.storage_dtype
    scaler = DynamicLossScaler(config.loss_scale) if config.precision == "fp16" else None
    torch.manual_seed(0)
    master = build(recipe.kind)
    opt = make_optimizer(master, recipe.optimizer)
    compute = build(recipe.kind).to(dtype)
    params, work = list(master.parameters()), list(compute.parameters())
    losses, skipped = [], 0
    for x, y in batches(recipe.kind, recipe.steps, recipe.batch):
        with torch.no_grad():
            for w, p in zip(work, params):
                w.copy_(p.to(storage))  # rounded to the storage dtype, then widened to the compute dtype
        scale = scaler.scale if scaler is not None else 1.0
        grads = [torch.zeros_like(p) for p in params]
        total = 0.0
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            rank_total = torch.zeros(())
            for xm, ym in zip(xs.chunk(recipe.accum), ys.chunk(recipe.accum)):
                loss = compute(xm, ym) / recipe.accum
                (loss * scale if scaler is not None else loss).backward()
                rank_total += loss.detach().float()
                for g, w in zip(grads, work):
                    if w.grad is not None:
                        g.add_(w.grad.float())
                compute.zero_grad(set_to_none=True)
            total += rank_total.item()
        losses.append(total / world)
        overflow = scaler is not None and not all(torch.isfinite(g).all() for g in grads)
        if scaler is not None:
            scaler.update(overflow)
        if overflow:
            skipped += 1
            continue
        for p, g in zip(params, grads):
            p.grad = g.div_(world).mul_(1.0 / scale)
        if recipe.clip:
            torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        opt.zero_grad()
    return losses, skipped


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


def lm_step_global(engine: zinf.ZeroInfinityEngine, ids: torch.Tensor, rank: int, world: int) -> float:
    """One step of a causal LM (transformers' ``input_ids=`` / ``labels=``) on this rank's slice of the global batch
    ``ids``; returns the global loss (the mean over ranks)."""
    mine = ids.chunk(world)[rank]
    loss = engine(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def step_global(engine: zinf.ZeroInfinityEngine, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """One step of ``engine(x, y)`` on this rank's slice of the global batch; returns the global loss (the mean over
    ranks)."""
    loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def train_global(engine: zinf.ZeroInfinityEngine, data: list, rank: int, world: int) -> list[float]:
    """One step per global batch of ``data``, each rank on its slice; returns the global losses (the mean over ranks)."""
    return [step_global(engine, x, y, rank, world) for x, y in data]
