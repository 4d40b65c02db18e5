"""The host and NVMe tiers of the parameter-shard store (the protocol and the device tier: zinf/param/store.py).

Chosen once per engine (``offload.params``) and built complete by the placement. The NVMe store reads
each rank's own shard (bandwidth-centric: every rank reads 1/world, then all-gather) into a buffer of the
pinned pool, ahead of use when the trace asks for it (``prefetch``). The host store and the copy of a
shard to the device that both use are here; the NVMe store is zinf/offload/nvme_param_store.py, its slots
zinf/offload/nvme_slots.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from zinf.device_memory import device_is_apart, host_empty, mark_device
from zinf.runtime.streams import BufferFence, Streams
from zinf.runtime.logs import region
from zinf.param.store import DeviceShardStore

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["CpuShardStore", "copy_in"]


def copy_in(streams: Streams, group: "FlatParamGroup", host: torch.Tensor) -> tuple[torch.Tensor, BufferFence]:
    """``host`` (a pinned shard) on ``group``'s device, copied on ``streams.copy_in``, and the fence that gates
    the reuse of ``host``; the all_gather stream is made to wait for the copy. See [Note: streams] in
    zinf/runtime/streams.py. With CPU compute ``host`` is the shard itself (no copy), and the fence a no-op, unless
    the device stands apart (see [Note: staged device] in zinf/device_memory.py)."""
    if not device_is_apart(group.device):
        shard = host
    else:
        shard = torch.empty(host.shape, dtype=host.dtype, device=group.device)  # on compute: the stream that frees it
        mark_device(shard)
        with region("h2d", group.name):
            streams.copy_in.wait_stream(streams.current())  # its block may be memory compute has just freed
            with streams.use(streams.copy_in):
                shard.copy_(host, non_blocking=True)
    fence = streams.record(streams.copy_in)
    fence.make_wait(streams.all_gather)
    return shard, fence


class CpuShardStore(DeviceShardStore):
    """Shards in (pinned, with CUDA) host memory, copied to the device for each gather (on the copy_in
    stream; a shard is rewritten by the optimizer only once its last copy has read it). No I/O: prefetch,
    done, commit, keep_for_backward, flush and close are the device tier's no-ops."""

    tier = "cpu"

    def __init__(self, groups: Sequence["FlatParamGroup"], streams: Streams) -> None:
        self._streams = streams  # the engine's: copies in on its copy_in stream
        self._shards: dict[int, torch.Tensor] = {}
        self._fences: dict[int, BufferFence] = {}  # the last copy-in of each shard
        self._groups = list(groups)
        for g in groups:
            shard = g.hand_over_shard()
            if device_is_apart(g.device):  # pinned with CUDA
                host = host_empty(shard.shape, shard.dtype, g.device)
                host.copy_(shard)
                shard = host
            self._shards[id(g)] = shard

    def fetch(self, group: "FlatParamGroup", defer_check: bool = False) -> torch.Tensor:
        shard, self._fences[id(group)] = copy_in(self._streams, group, self._shards[id(group)])
        return shard

    def read(self, group: "FlatParamGroup") -> torch.Tensor:
        return self._shards[id(group)]

    def writer(self, group: "FlatParamGroup") -> torch.Tensor:
        fence = self._fences.pop(id(group), None)
        if fence is not None:
            fence.wait()  # the host overwrites the shard: its copy to the device must have read it
        return self._shards[id(group)]

    def bytes_by_tier(self) -> dict[str, int]:
        """Shards that are not their group's master as well (fp32 on a CPU device with a device-tier optimizer: one
        tensor, counted once, as the master)."""
        total = 0
        for g in self._groups:
            shard = self._shards[id(g)]
            if g.master is None or g.master.data_ptr() != shard.data_ptr():
                total += shard.untyped_storage().nbytes()
        return {"cpu": total}
