"""The NVMe gradient stash (zinf/offload/grad_stash.py) gives its pool buffers back whatever a write's wait raises:
a failed gradient write leaves the pinned pool as it found it, and the other writes in flight are still waited."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from zinf import native
from zinf.offload import OffloadFileError
from zinf.offload.grad_stash import GRAD_WRITES_IN_FLIGHT, NvmeGradStash
from zinf.offload.pool_room import PoolRoom
from zinf.offload.subgroups import SubGroup
from zinf.offload.swap import SwapSpace

pytestmark = pytest.mark.skipif(not native.info().available, reason="the pinned pool needs the native build")

NUMEL = 1024


class _Group:
    shard_numel = 2 * NUMEL


def _stash(tmp_path: Path, aio: native.AsyncIO) -> tuple[NvmeGradStash, PoolRoom, list[_Group], Path]:
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    swap = SwapSpace([str(swap_dir)], rank=0, world=1, aio=aio)
    groups = [_Group() for _ in range(GRAD_WRITES_IN_FLIGHT + 2)]
    subgroups = [SubGroup(g, lo, lo + NUMEL, [], [], lo > 0) for g in groups for lo in (0, NUMEL)]
    records = {id(sg): {"grad": swap.allocate(NUMEL * 4)} for sg in subgroups}
    swap.open()
    room = PoolRoom(native.PinnedBufferPool(8 << 20))
    return NvmeGradStash(swap, room, subgroups, records), room, groups, swap_dir


def test_failed_gradient_writes_give_their_buffers_back(tmp_path: Path) -> None:
    with native.AsyncIO(backend="threads") as aio:
        stash, room, groups, swap_dir = _stash(tmp_path, aio)
        shard = torch.randn(2 * NUMEL)
        stash.write(groups[0], shard)
        stash.flush()
        assert torch.equal(stash.read(groups[0]), shard)
        assert room.pool.bytes_in_use == 0
        shutil.rmtree(swap_dir)  # every later write fails: its file's directory is gone
        with pytest.raises(OffloadFileError):
            for g in groups:  # more writes than are kept in flight: a wait inside write() fails
                stash.write(g, shard)
        with pytest.raises(OffloadFileError):  # the writes still in flight fail too, and are all waited
            stash.flush()
        assert room.pool.bytes_in_use == 0, "a failed wait kept its pool buffer"
        stash.flush()  # nothing is left in flight
