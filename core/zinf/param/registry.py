"""Which flat group holds each parameter. Keyed weakly by the parameter object; nothing is attached to it."""

from __future__ import annotations

from typing import Iterable

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zinf.param.flat_group import FlatParamGroup

__all__ = ["group_of", "register_group", "groups_of", "unregister"]

_GROUP_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def group_of(param: nn.Parameter) -> FlatParamGroup | None:
    return _GROUP_OF.get(param)


def register_group(group: FlatParamGroup) -> FlatParamGroup:
    for p in group.params:
        _GROUP_OF[p] = group
    return group


def groups_of(params: Iterable[nn.Parameter]) -> list[FlatParamGroup]:
    """The distinct groups of ``params``, in first-seen order (parameters zinf does not manage are skipped)."""
    seen: dict[int, FlatParamGroup] = {}
    for p in params:
        g = _GROUP_OF.get(p)
        if g is not None and id(g) not in seen:
            seen[id(g)] = g
    return list(seen.values())


def unregister(param: nn.Parameter) -> None:
    _GROUP_OF.pop(param, None)
