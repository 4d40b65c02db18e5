"""Where a group's compute-dtype parameter shard lives between uses: the store protocol, and the device tier.

One store per engine, chosen once from ``offload.params`` (zinf/placement.py) and built complete
by its constructor; groups only call ``fetch`` / ``done`` around their all-gather, ``writer`` /
``commit`` when their shard is rewritten (an optimizer step, an edit) and ``read`` when a frozen group's values
are read outside training (see [Note: frozen groups] in zinf/param/flat_group.py). The host and NVMe stores live in
zinf/offload/param_store.py; the rest of the engine never asks which one it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["ShardStore", "DeviceShardStore"]


class ShardStore(Protocol):
    tier: str

    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        """Start bringing ``group``'s shard closer (an NVMe read); False when there is no room for it now."""
        ...

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        """``group``'s shard on the compute device, the source of its all-gather. A store that copies it there (host
        or NVMe tiers, on CUDA) does so on the copy-in stream and makes the all-gather stream wait for that copy;
        the host buffer it copied from is reused only after the copy's fence (see zinf/runtime/streams.py)."""
        ...

    def done(self, group: "FlatParamGroup") -> None:
        """The all-gather that read ``fetch``'s tensor has finished."""
        ...

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        """``group``'s shard as it is now, at its storage width, on the host or the device (outside training: a
        checkpoint, a state dict, an export). The caller copies what it keeps."""
        ...

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        """A storage-dtype tensor of ``shard_numel`` elements to write ``group``'s new shard into."""
        ...

    def commit(self, group: "FlatParamGroup") -> None:
        """The new shard is written; store it."""
        ...

    def begin_update(self) -> None:
        """An optimizer step is about to write new shards (called on the training thread, before the step)."""
        ...

    def end_update(self) -> None:
        """The optimizer step has written every new shard (called on the thread that stepped)."""
        ...

    def keep_for_backward(self, keep: bool) -> None:
        """Whether shards gathered from now on are gathered again soon (a training forward's are, by its backward)."""
        ...

    def flush(self) -> None:
        """Finish every write in flight; afterwards the store's home alone holds the shards."""
        ...

    def close(self) -> None: ...

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of parameter shards this store keeps, per tier."""
        ...


class DeviceShardStore:
    """The device tier: the shard stays in the group, where compute runs."""

    tier = "device"

    def prefetch(self, group: "FlatParamGroup", demand: bool = False) -> bool:
        return True

    def fetch(self, group: "FlatParamGroup") -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def done(self, group: "FlatParamGroup") -> None:
        return None

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def commit(self, group: "FlatParamGroup") -> None:
        return None

    def begin_update(self) -> None:
        return None

    def end_update(self) -> None:
        return None

    def keep_for_backward(self, keep: bool) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def bytes_by_tier(self) -> dict[str, int]:
        return {}  # the group's own shard, counted with the group


DEVICE_STORE = DeviceShardStore()
