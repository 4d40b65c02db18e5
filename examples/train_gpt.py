"""Train a GPT with zinf from a plain PyTorch loop.

    torchrun --nproc_per_node 2 examples/train_gpt.py                     # CPU (gloo) or one GPU per rank (NCCL)
    python examples/train_gpt.py --config examples/configs/gpt_small.yaml zinf.precision=bf16 train.steps=10
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import zinf

sys.path.insert(0, os.path.dirname(__file__))
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

log = logging.getLogger("train_gpt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "gpt_small.yaml"))
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist, e.g. zinf.precision=bf16")
    args = parser.parse_args()
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))

    if "RANK" in os.environ:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(name)s: %(message)s")

    zcfg = zinf.ZeroConfig.from_dict(cfg.zinf)
    model_cfg = GPTConfig(**OmegaConf.to_container(cfg.model))
    torch.manual_seed(0)
    with zinf.Init(zcfg):  # no rank ever holds the whole model
        model = GPT(model_cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.train.lr)
    engine = zinf.initialize(model, optimizer, zcfg)
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    log.info("GPT with %.1fM parameters on %d rank(s), %s, device %s", numel / 1e6, world, zcfg.precision, engine.device)

    start = time.perf_counter()
    for step in range(cfg.train.steps):
        idx, targets = synthetic_batch(model_cfg, cfg.train.batch_per_rank, step, rank)
        loss = engine(idx.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
            log.info("step %d/%d loss %.4f | %s", step + 1, cfg.train.steps, loss.item(), engine.report().summary())
    log.info("done: %d steps in %.1f s", cfg.train.steps, time.perf_counter() - start)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
