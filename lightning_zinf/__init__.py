"""Lightning front end of zinf (ZeRO-Infinity for PyTorch).

``import lightning_zinf`` registers the strategy names (Lightning has no entry-point discovery for
strategies), after which ``Trainer(strategy="zero_infinity")`` and ``Fabric(strategy="zero_infinity")``
work. The classes are usable by path too: Hydra ``_target_: lightning_zinf.ZeroInfinityStrategy``,
LightningCLI ``class_path: lightning_zinf.ZeroInfinityStrategy``.
"""

import logging

from lightning_zinf.checkpoint import consolidate_state_dict, convert_to_lightning_checkpoint
from lightning_zinf.fabric import ZeroInfinityFabricPrecision, ZeroInfinityFabricStrategy
from lightning_zinf.precision import ZeroInfinityPrecision
from lightning_zinf.registry import register_all
from lightning_zinf.strategy import ZeroInfinityStrategy

logging.getLogger(__name__).addHandler(logging.NullHandler())

register_all()

__all__ = [
    "ZeroInfinityStrategy",
    "ZeroInfinityPrecision",
    "ZeroInfinityFabricStrategy",
    "ZeroInfinityFabricPrecision",
    "convert_to_lightning_checkpoint",
    "consolidate_state_dict",
    "register_all",
]
