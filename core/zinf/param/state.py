"""A flat group's state, beside its group (zinf/param/flat_group.py moves it through its verbs)."""

from __future__ import annotations

import enum

__all__ = ["GroupState"]


class GroupState(enum.Enum):
    """A flat group's state (zinf/param/flat_group.py moves it through its verbs): which tensors hold memory.

    SHARDED: the shard (and the fp32 master, unless frozen: see [Note: frozen groups]) only; parameters'
    ``.data`` are placeholders.
    GATHERING: an all-gather into the full buffer is in flight; parameters still placeholders.
    GATHERED: the full buffer holds the whole flat vector; parameters are views into it.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
