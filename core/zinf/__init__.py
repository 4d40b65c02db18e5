"""zinf: ZeRO-Infinity for PyTorch.

Parameters, gradients and optimizer states are split across data-parallel ranks; parameters are
gathered just in time by module hooks, with no change to model code.
"""

import logging

from zinf.recompute import ActivationMeter
from zinf.config import CheckpointConfig, CheckpointingConfig, LossScaleConfig, OverlapConfig, TilingConfig, ZeroConfig
from zinf.engine import ZeroInfinityEngine, initialize
from zinf.errors import (CheckpointError, CollectiveMismatchError, CollectiveTimeoutError, ConfigError,
                         UnsupportedModelError, ZinfError)
from zinf.checkpoint.pretrained import LoadReport, load_pretrained
from zinf.integrations import trainer as _trainer
from zinf.integrations import transformers as _transformers
from zinf.param.gathered import GatheredParameters
from zinf.init import Init
from zinf.report import StepReport
from zinf.tiling import TiledLinear, tile_linears

logging.getLogger("zinf").addHandler(logging.NullHandler())
_transformers.watch()  # from_pretrained under zinf.Init / zinf launch builds a partitioned model (integrations/)
_trainer.watch()  # transformers' Trainer saves and resumes a model trained by zinf (integrations/trainer.py)

__version__ = "0.1.0"

__all__ = [
    "ZeroConfig",
    "LossScaleConfig",
    "OverlapConfig",
    "TilingConfig",
    "CheckpointingConfig",
    "CheckpointConfig",
    "TiledLinear",
    "tile_linears",
    "ActivationMeter",
    "ZeroInfinityEngine",
    "initialize",
    "Init",
    "GatheredParameters",
    "load_pretrained",
    "LoadReport",
    "StepReport",
    "ZinfError",
    "ConfigError",
    "UnsupportedModelError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CheckpointError",
]
