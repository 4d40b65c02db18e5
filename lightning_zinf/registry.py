"""Strategy names: "zero_infinity", plus the offload presets "zero_infinity_offload" (CPU) and
"zero_infinity_nvme" (NVMe directories from ZINF_NVME_PATHS).

Lightning has no entry-point discovery for strategies; ``import lightning_zinf`` calls ``register_all``,
which registers in the unified ``lightning`` package and, when they are installed, in the standalone
``pytorch_lightning`` / ``lightning_fabric`` packages (with classes built for them: standalone.py).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zinf._shared import NAME, register_names
from lightning_zinf.fabric import ZeroInfinityFabricOffloadStrategy, ZeroInfinityFabricStrategy
from lightning_zinf.standalone import register_standalone
from lightning_zinf.strategy import ZeroInfinityOffloadStrategy, ZeroInfinityStrategy

__all__ = ["register_all", "register_pytorch", "register_fabric", "NAME"]

log = logging.getLogger(__name__)


def register_pytorch(registry: Any, strategy: type | None = None) -> None:
    register_names(registry, strategy or ZeroInfinityStrategy, ZeroInfinityOffloadStrategy)


def register_fabric(registry: Any, strategy: type | None = None) -> None:
    register_names(registry, strategy or ZeroInfinityFabricStrategy, ZeroInfinityFabricOffloadStrategy)


def register_all() -> None:
    """Register in ``lightning.pytorch`` and ``lightning.fabric``, and the standalone packages if installed."""
    register_pytorch(StrategyRegistry)
    register_fabric(STRATEGY_REGISTRY)
    register_standalone()
