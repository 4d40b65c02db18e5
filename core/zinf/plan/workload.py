"""What a run asks of the planner besides the model and the machine: ranks, tokens, and the settings that change
what is gathered, kept, read and written."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Workload"]


@dataclass(kw_only=True)
class Workload:
    world: int = 1
    batch_tokens: int = 2048  # tokens per rank per optimizer step
    seq_len: int = 1024
    checkpointing: bool = False
    ranks_per_node: int = 1
    pinned_pool_bytes: int | None = None  # None: the planner picks
    sub_group_numel: int = 8 << 20
    prefetch_bytes: int = 64 << 20  # overlap.prefetch_bytes
    prefetch_modules: int = 4  # overlap.prefetch_modules
    reshard_after_forward: str = "auto"  # overlap.reshard_after_forward
    host_keep: str = "auto"  # overlap.host_keep
    max_cpu_bytes: int = 0
