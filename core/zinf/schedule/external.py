"""Parameters used outside the module that owns them, found while the forward pass runs.

A torch function mode sees every tensor operation of the forward pass. When one of its arguments
is a zinf parameter whose group is not gathered (a tied weight read by the parent, a child's
weight used by a sibling), the group is gathered on behalf of the innermost running module, held
until that module's forward ends, and remembered as that module's external group so that its
backward (and later forwards) gather it up front. See ``ModuleHooks.on_external``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.overrides import TorchFunctionMode

from zinf.param.flat_group import GroupState
from zinf.param.registry import group_of

if TYPE_CHECKING:
    from zinf.schedule.hooks import ModuleHooks

__all__ = ["ExternalParamMode"]


class ExternalParamMode(TorchFunctionMode):
    def __init__(self, hooks: "ModuleHooks") -> None:
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # ``types`` does not list nn.Parameter (its torch function is the disabled default), so every
        # call's arguments are scanned; the engine's own ``p.data = ...`` in hook bodies is not a use
        if not self.hooks.busy:
            self._scan(args)
            if kwargs:
                self._scan(kwargs.values())
        return func(*args, **(kwargs or {}))

    def _scan(self, values: Any) -> None:
        for a in values:
            if isinstance(a, (list, tuple)):
                self._scan(a)
            elif type(a) is Parameter:
                g = group_of(a)
                if g is not None and g.state is not GroupState.GATHERED:
                    self.hooks.on_external(g)


Parameter = nn.Parameter
