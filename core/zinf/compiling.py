"""``torch.compile`` of a model zinf partitions, in place: the whole model, or each of its repeated blocks (regional
compilation). The module tree is left as it is (no ``OptimizedModule`` wrappers), so names, state dicts and zinf's
hooks are those of the eager model; how the hooks stay out of the graphs is [Note: compiled modules] in
zinf/schedule/hooks.py."""

from __future__ import annotations

from typing import Any

from torch import nn

from zinf.errors import UnsupportedModelError
from zinf.schedule.units import repeated_blocks

__all__ = ["compile_model"]


def compile_model(model: nn.Module, regional: bool = False, **options: Any) -> list[nn.Module]:
    """``Module.compile(**options)`` on ``model``, or with ``regional`` on each repeated block (the model's
    ``_no_split_modules`` classes, else the layers of its largest ``ModuleList``), the rest staying eager; returns the
    modules compiled. ``options`` are ``torch.compile``'s (``backend``, ``mode``, ``fullgraph``, ``dynamic``,
    ``options``)."""
    if options.get("fullgraph") and not regional:
        raise UnsupportedModelError(
            "zinf: fullgraph=True of the whole model: zinf gathers and releases parameters in hooks around the "
            "modules inside it, outside any graph. Compile the repeated blocks instead (regional=True, or "
            "dynamo_use_regional_compilation in an Accelerate config), or drop fullgraph.")
    targets = [model]
    if regional:
        blocks = repeated_blocks(model)
        inner = {id(m) for b in blocks for m in b.modules() if m is not b}
        targets = [b for b in blocks if id(b) not in inner] or [model]  # the outermost blocks
    for module in targets:
        module.compile(**options)
    return targets
