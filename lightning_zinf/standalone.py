"""The strategies for the standalone ``pytorch_lightning`` and ``lightning_fabric`` packages.

Those packages are Lightning's own source with ``lightning.pytorch`` renamed ``pytorch_lightning`` and
``lightning.fabric`` renamed ``lightning_fabric``, so their base classes are distinct from the unified
package's and a strategy must subclass theirs. The variants here are built the way Lightning builds
those packages: ``precision.py``, ``strategy.py`` and ``fabric.py`` are loaded again with the two
import prefixes renamed, as ``lightning_zinf._standalone_*`` modules. One source, two sets of classes.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

from lightning_zinf._shared import register_names

__all__ = ["load", "register_standalone"]

log = logging.getLogger(__name__)

_RENAMES = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    ("lightning_zinf.precision", "lightning_zinf._standalone_precision"),
)


def load(name: str) -> ModuleType:
    """``lightning_zinf/{name}.py`` built against the standalone packages (cached in ``sys.modules``)."""
    module_name = f"lightning_zinf._standalone_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = Path(__file__).with_name(f"{name}.py")
    source = path.read_text()
    for old, new in _RENAMES:
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(module_name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[module_name] = module
    try:
        exec(compile(source, f"{path} (for the standalone Lightning packages)", "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def register_standalone() -> bool:
    """Register "zero_infinity" and the offload presets in ``pytorch_lightning`` and ``lightning_fabric``,
    when both are installed; returns whether they were."""
    if importlib.util.find_spec("pytorch_lightning") is None or importlib.util.find_spec("lightning_fabric") is None:
        return False
    from lightning_fabric.strategies import STRATEGY_REGISTRY
    from pytorch_lightning.strategies import StrategyRegistry

    load("precision")
    strategy, fabric = load("strategy"), load("fabric")
    register_names(StrategyRegistry, strategy.ZeroInfinityStrategy, strategy.ZeroInfinityOffloadStrategy)
    register_names(STRATEGY_REGISTRY, fabric.ZeroInfinityFabricStrategy, fabric.ZeroInfinityFabricOffloadStrategy)
    log.debug("zinf: registered zero_infinity in pytorch_lightning and lightning_fabric")
    return True
