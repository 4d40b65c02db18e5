"""Where a group's parameter shard is kept between gathers: the store (the device tier until an offload placement
moves it, once), the construction spill it may wait in before that, and its place in checkpoint files when it is
read from there."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from zinf.param.keys import GroupKey
from zinf.param.store import DEVICE_STORE, ShardStore, UpdateFence

__all__ = ["ShardResidence", "ShardSpill"]

_NO_FENCE = UpdateFence()


class ShardSpill(ShardStore, Protocol):
    """Where ``zinf.Init`` keeps shards built for NVMe until the engine's placement takes them (see [Note:
    construction spill] in zinf/offload/spill_store.py)."""

    path: str  # the file, whose disk space comes back as the placement takes the shards
    in_place: bool  # loaders may leave shards where checkpoint files hold them (see [Note: frozen shards in place])

    def add(self, group: GroupKey, shard: torch.Tensor | None) -> None: ...
    def take(self, group: GroupKey) -> torch.Tensor: ...
    def write(self, group: GroupKey, fill: Callable[[torch.Tensor], object]) -> None:
        """``fill`` writes the new shard, at the storage width, into the store's buffer; the store commits it."""
        fill(self.store.writer(group))
        self.store.commit(group)

    def in_place_record(self, group: GroupKey) -> Any: ...
    def take_in_place(self, group: GroupKey) -> Any: ...
    def keep_in_place(self, group: GroupKey, record: Any) -> None: ...


class ShardResidence:
    """The store that keeps one group's shard, the spill it waits in before its placement, and the fence that says
    whether a background step is still producing it."""

    def __init__(self) -> None:
        # [Note: placement] built on the device tier; an offload placement moves the group once (``place``)
        self.store: ShardStore = DEVICE_STORE
        self.spill: ShardSpill | None = None  # [Note: construction spill]: the shard waits there for the placement
        self.fence = _NO_FENCE
        self.placed = False
        # the store reads every rank's shard: gathered without a collective ([Note: frozen groups read whole] in
        # zinf/offload/whole_reads.py)
        self.whole = False

    def place(self, group: GroupKey, store: ShardStore, fence: UpdateFence, whole: bool = False) -> None:
        if self.placed:
            raise RuntimeError(f"zinf: {group.name} is already placed by another engine; build a new model for a "
                               "second engine with offload, or close() the first and rebuild the model.")
        self.store, self.fence, self.placed, self.whole = store, fence, True, whole

    def gather_own(self) -> None:
        """The store keeps this rank's shard alone from now on (new values written): all-gathered again."""
        self.whole = False

    def spill_to(self, group: GroupKey, spill: ShardSpill, shard: torch.Tensor | None) -> None:
        """The shard (None: placeholders a loader replaces) waits in ``spill`` from now on."""
        spill.add(group, shard)
        self.store, self.spill = spill, spill

    @property
    def spilled(self) -> bool:
        return self.spill is not None

    @property
    def spill_path(self) -> str | None:
        """The construction spill file the shard waits in for the placement, if it does."""
        return self.spill.path if self.spill is not None else None

    def take_spilled(self, group: GroupKey) -> torch.Tensor:
        """Read the shard back from the spill, which lets it go (one group at a time)."""
        assert self.spill is not None
        shard, self.spill = self.spill.take(group), None
        return shard

    def back_to_device(self) -> None:
        """The shard came back from the spill into the group, on the device tier."""
        self.store = DEVICE_STORE

    def write(self, group: GroupKey, fill: Callable[[torch.Tensor], object]) -> None:
        """``fill`` writes the new shard, at the storage width, into the store's buffer; the store commits it."""
        fill(self.store.writer(group))
        self.store.commit(group)

    def in_place_record(self, group: GroupKey) -> Any:
        """Where the shard lies in checkpoint files while it waits in the spill, if it was loaded so: an
        ``InPlaceRecord``, opaque here (see [Note: frozen shards in place] in zinf/offload/in_place.py)."""
        return self.spill.in_place_record(group) if self.spill is not None and group.shard is None else None

    def may_load_in_place(self, group: GroupKey) -> bool:
        return self.spill is not None and group.shard is None and self.spill.in_place

    def keep_in_place(self, group: GroupKey, record: Any) -> None:
        """The shard's values are the bytes ``record`` names in checkpoint files (read once, for the checksum;
        nothing is written)."""
        assert self.may_load_in_place(group), f"{group.name}: keep_in_place"
        assert self.spill is not None
        self.spill.keep_in_place(group, record)

    def take_in_place(self, group: GroupKey) -> Any:
        """Give the store the shard's place in the checkpoint files instead of the shard (nothing is read)."""
        assert self.spill is not None, f"{group.name}: take_in_place"
        record, self.spill = self.spill.take_in_place(group), None
        return record
