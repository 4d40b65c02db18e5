"""Train the example GPT with Lightning, zinf and a Hydra experiment config (config.yaml beside this file).

    python examples/hydra/train.py
    python examples/hydra/train.py strategy.config.precision=bf16 trainer.max_steps=50 model.n_layer=6
    python examples/hydra/train.py strategy.config.offload.optimizer=cpu
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from lightning.pytorch import seed_everything
from omegaconf import DictConfig
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpt import GPTConfig  # noqa: E402
from lightning_gpt import CopyTask, LitGPT  # noqa: E402


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg: DictConfig) -> None:
    seed_everything(cfg.seed)
    gpt = GPTConfig(**cfg.model)
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    model = LitGPT(gpt, lr=cfg.lr)
    trainer.fit(model, DataLoader(CopyTask(gpt, 2048), batch_size=cfg.batch_size))
    if trainer.is_global_zero:
        print(f"final train loss {trainer.callback_metrics['train_loss'].item():.6f}")


if __name__ == "__main__":
    main()
