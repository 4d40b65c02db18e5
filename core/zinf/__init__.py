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
from zinf.integrations import trainer as _trainer  # noqa: F401 - registers its watch (integrations/__init__)
from zinf.integrations import transformers as _transformers  # noqa: F401 - registers its watch
from zinf.param.gathered import GatheredParameters
from zinf.init import Init
from zinf.report import StepReport
from zinf.tiling import TiledLinear, tile_linears

logging.getLogger("zinf").addHandler(logging.NullHandler())
# Importing zinf patches no other library: zinf.Init, the engine and zinf launch activate the transformers glue
# ([Note: integrations are activated, not imported] in zinf/integrations/__init__.py).

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
