"""How much host memory a run has, and whether it is short of it: the kernel's available memory bounded by a
cgroup's limit (``available_ram``), and the engine's choice to trim glibc's heap during the step
(``trims_host_heap``; [Note: heap growth] in zinf/heap.py)."""

from __future__ import annotations

import logging
import os

import torch

from zinf.config import ZeroConfig
from zinf.config_sections import OffloadConfig
from zinf.heap import HeapTrimmer

__all__ = ["available_ram", "cgroup_room", "trims_host_heap", "start_heap_trims", "keep_room", "keep_share",
           "HEAP_PRESSURE_SHARE", "KEEP_SHARE"]

log = logging.getLogger(__name__)


def available_ram(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The host memory this process can still take: the kernel's MemAvailable, or less where a cgroup's memory limit
    (a container's) leaves less."""
    host, room = _mem_available(), cgroup_room(cgroup_root)
    return host if room is None else min(host, room)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")  # pragma: no cover - non-Linux


def cgroup_room(root: str = "/sys/fs/cgroup", own: str | None = None) -> int | None:
    """What this process's cgroup's memory limit leaves (limit less usage), None where there is no limit or none can
    be read: cgroup v2 (``memory.max``, ``memory.current`` of the process's own cgroup ``own``, by default from
    /proc/self/cgroup), else v1 (``memory/memory.limit_in_bytes``, ``memory/memory.usage_in_bytes``)."""
    if own is None:
        own = ""
        try:
            with open("/proc/self/cgroup") as f:
                own = next((line.strip()[3:] for line in f if line.startswith("0::")), "")
        except OSError:
            pass
    v2 = os.path.join(root, own.lstrip("/"))
    for limit_file, usage_file in ((os.path.join(v2, "memory.max"), os.path.join(v2, "memory.current")),
                                   (os.path.join(root, "memory", "memory.limit_in_bytes"),
                                    os.path.join(root, "memory", "memory.usage_in_bytes"))):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            if limit == "max":
                return None
            with open(usage_file) as f:
                usage = int(f.read().strip())
            if int(limit) >= 1 << 60:  # v1 without a limit: the largest page-aligned long
                return None
            return max(0, int(limit) - usage)
        except (OSError, ValueError):
            continue
    return None


# the share of the host's available memory the ranks' gathered models may take before the heap is trimmed
HEAP_PRESSURE_SHARE = 0.25


def trims_host_heap(cfg: OffloadConfig, device: torch.device, model_bytes: int, ranks_on_host: int,
                    free_host_bytes: int) -> bool:
    """Whether freed gathers and gradients should go back to the system during the step (``trim_heap_bytes``,
    [Note: heap growth] in zinf/heap.py): they are host memory (CPU compute), the parameters are offloaded, and host
    memory is what the run is short of: ``offload.max_cpu_bytes`` states a budget, or the ranks on this host
    together gather models (``model_bytes`` each, at the compute width) larger than ``HEAP_PRESSURE_SHARE`` of the
    memory their placements leave free (``free_host_bytes``), which what glibc keeps could exhaust. Elsewhere the
    heap keeps its pages and glibc its own threshold: trimming costs step time in page faults."""
    if device.type != "cpu" or cfg.params == "device":
        return False
    return cfg.max_cpu_bytes > 0 or ranks_on_host * model_bytes > HEAP_PRESSURE_SHARE * free_host_bytes


def start_heap_trims(heap: HeapTrimmer, config: ZeroConfig, device: torch.device, model_bytes: int,
                     ranks_on_host: int, free_host_bytes: int) -> None:
    """Start the engine's heap trimmer (built off, before its placement) where ``trims_host_heap`` says so."""
    trims = trims_host_heap(config.offload, device, model_bytes, ranks_on_host, free_host_bytes)
    heap.start(config.trim_heap_bytes if trims else 0)
    log.debug("zinf: the host heap is %s during the step", "trimmed" if heap.every_bytes else "left to glibc")


# the share of the memory the placements leave free that the ranks of a host may keep gathered for the backward
KEEP_SHARE = 0.25


def keep_room(config: ZeroConfig, device: torch.device, ranks_on_host: int, free_host_bytes: int) -> int:
    """Host memory one rank gives to keeping gathered groups from their forward to their backward, beyond
    ``overlap.prefetch_bytes`` ([Note: keeping in the host's room] in zinf/schedule/keep.py): ``KEEP_SHARE`` of what
    the placements leave free, split between the host's ranks, where the gathers are host memory (CPU compute) and
    nothing bounds them otherwise (``overlap.host_keep`` and ``reshard_after_forward`` "auto", no
    ``max_gathered_bytes``, no ``offload.max_cpu_bytes``); 0 elsewhere."""
    overlap = config.overlap
    if (device.type != "cpu" or overlap.host_keep != "auto" or overlap.reshard_after_forward != "auto"
            or overlap.max_gathered_bytes or config.offload.max_cpu_bytes):
        return 0
    return keep_share(free_host_bytes, ranks_on_host)


def keep_share(free_host_bytes: int, ranks_on_host: int) -> int:
    """One rank's share of the room: ``KEEP_SHARE`` of the host's free memory, split between its ranks (the
    engine's ``keep_room`` and the planner's)."""
    return max(0, int(KEEP_SHARE * free_host_bytes)) // max(1, ranks_on_host)
