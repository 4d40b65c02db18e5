"""Train the example GPT with Lightning, zinf and a Hydra experiment config (config.yaml beside this file).

    python examples/hydra/train.py
    python examples/hydra/train.py zinf=cpu_offload zinf.precision=bf16 trainer.max_steps=50 model.n_layer=6
    python examples/hydra/train.py zinf=nvme zinf.offload.nvme_paths=[/mnt/nvme0,/mnt/nvme1]
    python examples/hydra/train.py --cfg job          # print the composed config
    python examples/hydra/train.py --info defaults    # which presets were picked

The engine config is the ``zinf`` node, one of the presets that ``zinf.hydra_configs.register_configs()``
stores in Hydra's ConfigStore, typed by ``zinf.ZeroConfig``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from zinf import ConfigError, ZeroConfig
from zinf.cli import traceback_wanted
from zinf.hydra_configs import register_configs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

register_configs()  # zinf/{schema,default,cpu_offload,...}, strategy/zero_infinity, accelerator/zinf


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg: DictConfig) -> None:
    # Hydra checked keys and types when it composed cfg; the engine checks the values (and a ??? left unset)
    # here, naming the key, before any process starts: a bad value is one line on stderr and exit code 2, as in
    # examples/train_gpt.py. The strategy node builds its own from ${zinf}.
    try:
        ZeroConfig.from_dict(cfg.zinf)
    except ConfigError as exc:
        if traceback_wanted():
            raise
        sys.stderr.write(f"train.py: error: {' '.join(str(exc).split())} (ZINF_TRACEBACK=1 shows the traceback)\n")
        sys.exit(2)
    # Lightning and the model are imported once the settings are known good: a bad setting is refused in about
    # two seconds, not after Lightning's import (about seven on a 2-core machine)
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from gpt import GPTConfig
    from lightning_gpt import CopyTask, LitGPT

    seed_everything(cfg.seed)
    gpt = GPTConfig(**cfg.model)
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    model = LitGPT(gpt, lr=cfg.lr)
    trainer.fit(model, DataLoader(CopyTask(gpt, 2048), batch_size=cfg.batch_size))
    if trainer.is_global_zero:
        print(f"final train loss {trainer.callback_metrics['train_loss'].item():.6f}")


if __name__ == "__main__":
    main()
