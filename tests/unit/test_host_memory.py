"""zinf/host_memory.py: the engine's transient host bytes by kind, their high-water mark between two reads, device
memory left out, and every freed block told to the heap trimmer."""

from __future__ import annotations

import torch

from zinf.heap import HeapTrimmer
from zinf.host_memory import HostMemory

CPU, META = torch.device("cpu"), torch.device("meta")


def test_counts_host_bytes_by_kind_and_keeps_the_high_water_mark() -> None:
    trimmer = HeapTrimmer(10 << 20)
    host = HostMemory(trimmer)
    host.allocated("gathered", 6 << 20, CPU)
    host.allocated("grad_buffers", 4 << 20, CPU)
    host.allocated("gathered", 100 << 20, META)  # not host memory: not counted
    host.freed("gathered", 6 << 20, CPU)
    host.allocated("gathered", 1 << 20, CPU)
    assert host.held == {"gathered": 1 << 20, "grad_buffers": 4 << 20}
    assert host.total == 5 << 20
    assert host.take_peak() == 10 << 20
    assert host.take_peak() == 5 << 20  # the next mark starts from what is held
    host.freed("grad_buffers", 4 << 20, CPU)
    assert trimmer.trims == 1  # 6 + 4 MiB freed: past the trimmer's 10 MiB
    host.freed("gathered", 100 << 20, META)
    assert host.total == 1 << 20 and host.take_peak() == 5 << 20
