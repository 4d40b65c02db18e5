"""Finding the tensors in a module's inputs and outputs, whatever their structure.

torch's pytree covers tuples, lists, dicts, named tuples and registered nodes (``transformers``'
``ModelOutput`` registers itself). Plain ``@dataclass`` instances and unregistered container
subclasses are leaves to pytree, so they are opened here too: a tensor a hook does not see is a
module whose backward is never announced, and its released parameters would then be read in backward.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["tensors_in", "map_tensors"]


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in a stable order."""
    out: list[torch.Tensor] = []
    _collect(obj, out, set())
    return out


def _collect(obj: Any, out: list[torch.Tensor], seen: set[int]) -> None:
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif id(leaf) in seen:
            continue
        elif _is_dataclass_instance(leaf):
            seen.add(id(leaf))
            _collect([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)], out, seen)
        elif isinstance(leaf, Mapping):
            seen.add(id(leaf))
            _collect(list(leaf.values()), out, seen)
        elif isinstance(leaf, (list, tuple)):
            seen.add(id(leaf))
            _collect(list(leaf), out, seen)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; dataclasses are copied, never changed in place."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _is_dataclass_instance(x):
            new = copy.copy(x)
            for f in dataclasses.fields(x):
                if hasattr(x, f.name):
                    object.__setattr__(new, f.name, map_tensors(fn, getattr(x, f.name)))
            return new
        return x

    return tree_map(leaf, obj)
