"""zinf/host_room.py: when an engine trims the heap during the step (host memory short: a budget stated, or the
models a large share of what the placements leave free), the room it gives to groups kept for the backward, and the
memory counted as available (a cgroup's limit bounds the kernel's figure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.config_sections import OffloadConfig
from zinf.config import ZeroConfig
from zinf.host_room import available_ram, cgroup_room, keep_room, trims_host_heap

GIB = 1 << 30
CPU = torch.device("cpu")


@pytest.mark.parametrize("params, budget, model, ranks, device, trims", [
    ("nvme", 0, 1 * GIB, 2, CPU, False),  # 2 GiB of models against 16 GiB free: host memory is not short
    ("nvme", 0, 3 * GIB, 2, CPU, True),  # 6 GiB: more than a quarter
    ("cpu", 0, 5 * GIB, 1, CPU, True),
    ("nvme", 32 * GIB, 1 << 20, 1, CPU, True),  # a budget stated: host memory is what the run is short of
    ("device", 8 * GIB, 8 * GIB, 2, CPU, False),  # the parameters in memory: nothing gathered is freed
    ("nvme", 8 * GIB, 8 * GIB, 2, torch.device("cuda"), False),  # gathers on the GPU are device memory
])
def test_the_heap_is_trimmed_where_host_memory_is_short(params, budget, model, ranks, device, trims) -> None:
    cfg = OffloadConfig(params=params, optimizer="cpu", max_cpu_bytes=budget, nvme_paths=["/tmp"])
    assert trims_host_heap(cfg, device, model, ranks, free_host_bytes=16 * GIB) is trims


@pytest.mark.parametrize("overlap, offload, device, room", [
    ({}, {}, CPU, 2 * GIB),  # a quarter of 16 GiB, split between 2 ranks
    ({"host_keep": "off"}, {}, CPU, 0),
    ({"reshard_after_forward": "always"}, {}, CPU, 0),  # nothing kept, so no room for it
    ({"reshard_after_forward": "never"}, {}, CPU, 0),  # everything kept already, without a room
    ({"max_gathered_bytes": 1 << 30}, {}, CPU, 0),  # the user's cap on gathers decides
    ({}, {"params": "nvme", "optimizer": "cpu", "nvme_paths": ["/tmp"], "max_cpu_bytes": 4 * GIB}, CPU, 0),
    ({}, {}, torch.device("cuda"), 0),  # gathers on a GPU are device memory
])
def test_the_room_for_keeping_is_host_memory_to_spare(overlap, offload, device, room) -> None:
    config = ZeroConfig.from_dict({"overlap": overlap, "offload": offload})
    assert keep_room(config, device, ranks_on_host=2, free_host_bytes=16 * GIB) == room


def _files(root: Path, **files: str) -> str:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_a_cgroup_limit_bounds_the_memory_available(tmp_path: Path) -> None:
    """A container's memory limit, not the host's free memory, is what the run may take (cgroup v2 at the root of
    the process's namespace, v1's memory controller); no limit, or none readable, leaves MemAvailable."""
    v2 = _files(tmp_path / "v2", **{"memory.max": "8589934592\n", "memory.current": "1073741824\n"})
    assert cgroup_room(v2, own="/") == 7 * GIB
    nested = _files(tmp_path / "nested", **{"pod/memory.max": "2147483648", "pod/memory.current": "0"})
    assert cgroup_room(nested, own="/pod") == 2 * GIB
    v1 = _files(tmp_path / "v1", **{"memory/memory.limit_in_bytes": "4294967296", "memory/memory.usage_in_bytes": "0"})
    assert cgroup_room(v1) == 4 * GIB
    unlimited = _files(tmp_path / "max", **{"memory.max": "max\n", "memory.current": "5"})
    assert cgroup_room(unlimited, own="/") is None
    v1_unlimited = _files(tmp_path / "v1max", **{"memory/memory.limit_in_bytes": "9223372036854771712",
                                                 "memory/memory.usage_in_bytes": "5"})
    assert cgroup_room(v1_unlimited) is None
    assert cgroup_room(str(tmp_path / "none")) is None
    assert available_ram(str(tmp_path / "none")) > 0


@pytest.mark.parametrize("budget, every", [(0, 0), (4 * GIB, 64 << 20)])
def test_an_engine_trims_a_small_model_only_under_a_stated_budget(budget, every) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    config = zinf.ZeroConfig.from_dict({"offload": {"params": "cpu", "optimizer": "cpu", "max_cpu_bytes": budget}})
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters()), config)
    try:
        assert engine.heap.every_bytes == every
    finally:
        engine.close()
