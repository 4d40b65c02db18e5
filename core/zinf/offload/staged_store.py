"""The device tier when the optimizer steps on the host: shards on the device, updates staged through host buffers.

[Note: staged updates]
With ``offload.params: device`` and the optimizer on the CPU or NVMe, the parameter shards live on the compute
device while the CPU-Adam writes the new ones on the host. The store keeps each group's device shard and hands the
optimizer a host staging buffer at the storage width (``writer``: pinned with CUDA, one of a ring of
``NUM_STAGING`` buffers the size of the largest shard); ``commit`` copies it into the device shard without the host
waiting, on the copy-in stream, after the compute stream's work up to the step (``begin_update``: the backward's
last reads of the shards), and keeps the copy's fence: the group's next all-gather waits for it on the device
(``fetch``), and the staging buffer is filled again only once the copy has read it (a host wait on the copy-in
stream, never on compute). On CPU this runs only under the staged setting ([Note: staged device] in
zinf/device_memory.py); without it the device is the host, and the plain device tier (zinf/param/store.py) is used.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

import torch

from zinf.param.store import DeviceShardStore
from zinf.device_memory import host_empty
from zinf.runtime.streams import BufferFence, Streams
from zinf.runtime.logs import region

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["StagedDeviceStore", "NUM_STAGING"]

NUM_STAGING = 2  # one being filled by the CPU-Adam, one being copied to the device


class StagedDeviceStore(DeviceShardStore):
    tier = "device"

    def __init__(self, groups: Sequence["FlatParamGroup"], streams: Streams) -> None:
        self._groups = list(groups)
        self._shards: dict[int, torch.Tensor] = {id(g): g.hand_over_shard() for g in self._groups}
        self.device = self._groups[0].device if self._groups else torch.device("cpu")
        self._streams = streams  # the engine's
        nbytes = max((g.shard_nbytes for g in self._groups), default=0)
        self._ring: list[tuple[torch.Tensor, BufferFence | None]] = [
            (host_empty(nbytes, torch.uint8, self.device), None) for _ in range(NUM_STAGING)]
        self._next = 0
        self._staging: dict[int, int] = {}  # group -> the ring buffer its update is written into
        self._landing: dict[int, BufferFence] = {}  # group -> the copy of its last update, not yet waited for by a gather
        self._after: BufferFence | None = None  # compute's work up to the step that writes the shards
        self._lock = threading.Lock()  # the background optimizer step commits while the training thread gathers

    def begin_update(self) -> None:
        self._after = self._streams.record(self._streams.current())

    def end_update(self) -> None:
        self._after = None

    def fetch(self, group: "FlatParamGroup", defer_check: bool = False) -> torch.Tensor:
        with self._lock:
            landing = self._landing.pop(id(group), None)
        if landing is not None:
            landing.make_wait(self._streams.all_gather)
        return self._shards[id(group)]

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        with self._lock:
            landing = self._landing.get(id(group))
        if landing is not None:
            landing.make_wait(self._streams.current())
        return self._shards[id(group)]

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        with self._lock:
            index = self._staging.get(id(group))
            if index is None:  # the first sub-group of this update
                index, self._next = self._next, (self._next + 1) % len(self._ring)
                self._staging[id(group)] = index
            buf, copied = self._ring[index]
            self._ring[index] = (buf, None)
        if copied is not None:
            copied.wait()  # its last copy to the device has read it (the copy-in stream, not compute)
        return buf[: group.shard_nbytes].view(group.storage_dtype)

    def commit(self, group: "FlatParamGroup") -> None:
        with self._lock:
            index = self._staging.pop(id(group))
        buf = self._ring[index][0]
        shard = self._shards[id(group)]
        streams = self._streams
        with region("h2d", group.name):
            after = self._after
            if after is not None:  # the step: after compute's work up to it, on any thread
                after.make_wait(streams.copy_in)
            else:  # an edit outside a step, on the training thread
                streams.copy_in.wait_stream(streams.current())
            with streams.use(streams.copy_in):
                shard.copy_(buf[: shard.numel() * shard.element_size()].view(shard.dtype), non_blocking=True)
            copied = streams.record(streams.copy_in)
        with self._lock:
            self._ring[index] = (buf, copied)
            self._landing[id(group)] = copied

    def flush(self) -> None:
        with self._lock:
            copies = [c for _, c in self._ring if c is not None]
        for copied in copies:
            copied.wait()

    def close(self) -> None:
        self.flush()

    def bytes_by_tier(self) -> dict[str, int]:
        return {"device": sum(t.untyped_storage().nbytes() for t in self._shards.values())}
