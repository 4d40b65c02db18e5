"""What the pinned pool must hold for a placement: the blocks that never wait for room, checked before anything is
allocated, and the frozen groups it can stage whole ([Note: frozen groups read whole] in zinf/offload/whole_reads.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Mapping, Sequence

from zinf.offload.grad_stash import GRAD_WRITES_IN_FLIGHT
from zinf.offload.in_place import InPlaceRecord
from zinf.offload.pool_room import block_bytes
from zinf.offload.subgroups import ALIGN_NUMEL
from zinf.offload.swap import OffloadSpaceError, record_span
from zinf.units import format_bytes

if TYPE_CHECKING:
    from zinf.config_sections import OffloadConfig
    from zinf.offload.state_layout import StateLayout
    from zinf.offload.subgroups import SubGroup
    from zinf.param.flat_group import FlatParamGroup

__all__ = ["PoolNeeds"]


class PoolNeeds:
    """The pool blocks of one placement: its groups' shards (``in_place``: the records of frozen shards read from
    checkpoint files, by group id, updated as groups are read whole) and the offloaded optimizer's sub-groups."""

    def __init__(self, cfg: "OffloadConfig", groups: Sequence["FlatParamGroup"], in_place: Mapping[int, InPlaceRecord],
                 subgroups: Sequence["SubGroup"], layout: "StateLayout", grads_on_nvme: bool) -> None:
        self.cfg, self.groups, self.in_place = cfg, list(groups), in_place
        self.subgroups, self.layout, self.grads_on_nvme = list(subgroups), layout, grads_on_nvme

    def staged_bytes(self, group: "FlatParamGroup") -> int:
        """A group's pool block: its swap record's span, or the larger span of a frozen shard read from checkpoint
        files (see [Note: reading extents directly] in zinf/offload/in_place.py)."""
        rec = self.in_place.get(id(group))
        return block_bytes(max(record_span(group.shard_nbytes), rec.span if rec else 0))

    @functools.cached_property
    def largest_staged(self) -> int:
        """The pool bytes staging the largest group takes (its power-of-two block); read once groups are placed."""
        return max(self.staged_bytes(g) for g in self.groups)

    def fixed(self) -> tuple[int, int]:
        """The pool bytes the optimizer's pipeline never waits for, and the largest trained shard's block."""
        cfg = self.cfg
        pipeline = trained = 0
        if cfg.optimizer == "nvme" and self.subgroups:
            biggest = max(self.subgroups, key=lambda sg: sg.numel)
            pipeline = self._pipeline([self.layout.nbytes(biggest, n) for n in self.layout.names], biggest.numel)
        if cfg.params == "nvme" and self.groups:
            trained = max((self.staged_bytes(g) for g in self.groups if g.trainable), default=0)
        return pipeline, trained

    def _pipeline(self, state_bytes: list[int], numel: int) -> int:
        """The pipeline's blocks for sub-groups whose states' records hold ``state_bytes`` (and the gradient's, of
        ``numel`` fp32 elements, when it is on NVMe): three sub-groups in flight (read ahead, stepped, written)."""
        spans = [record_span(n) for n in state_bytes] + ([record_span(numel * 4)] if self.grads_on_nvme else [])
        return 3 * sum(block_bytes(span) for span in spans)

    def that_fit(self, whole: Mapping[int, InPlaceRecord]) -> dict[int, InPlaceRecord]:
        """Of the whole records (``whole_records``), those the pool can stage beside what never waits for room
        (``check``): a group whose whole block would raise the pool's need past ``offload.pinned_pool_bytes`` stays
        all-gathered. The same on every rank (the same config and records)."""
        if not whole:
            return {}
        pipeline, trained = self.fixed()
        allowed = max(max(self.staged_bytes(g) for g in self.groups),
                      (self.cfg.pinned_pool_bytes - pipeline - 2 * trained) // 2)
        return {k: r for k, r in whole.items() if block_bytes(r.span) <= allowed}

    def check(self) -> tuple[int, int]:
        """Check the pool can hold what must never wait for room; return the room the parameter store's
        read-ahead leaves free (the reserve below) and the room the optimizer's read-ahead of the next step's
        states leaves for the backward.

        Never waits: the offloaded optimizer's pipeline (three states each, and the gradient when it is on
        NVMe, for the sub-groups read ahead, stepped and written behind) and, with parameters on NVMe, the
        reserve: the largest shard once (a read for a gather) and the largest trained shard twice (an updated
        shard staged, one being written; a frozen shard is never rewritten), in the pool's power-of-two block
        sizes; plus room to read one shard ahead. Everything beyond that is opportunistic and given back on
        demand (the pool room's evictors)."""
        cfg = self.cfg
        pipeline, trained = self.fixed()
        largest = self.largest_staged if cfg.params == "nvme" and self.groups else 0
        reserve = largest + 2 * trained
        need = pipeline + reserve + largest
        grad_writes = 0
        if self.grads_on_nvme and self.subgroups:
            grad_writes = (GRAD_WRITES_IN_FLIGHT + 1) * block_bytes(max(record_span(sg.numel * 4) for sg in self.subgroups))
        if need > cfg.pinned_pool_bytes:
            raise OffloadSpaceError(self._shortfall(need, pipeline, reserve + largest))
        return reserve, reserve + grad_writes + cfg.pinned_pool_bytes // 4

    def _shortfall(self, need: int, pipeline: int, params: int) -> str:
        """Why the pool is too small (the optimizer's pipeline, the parameter shards) and the settings that would each
        make it enough: a smaller sub-group only where the parameter shards leave room for the smallest one."""
        cfg = self.cfg
        pool = cfg.pinned_pool_bytes
        parts, fixes = [], [f"Raise offload.pinned_pool_bytes to at least {need}"]
        if pipeline:
            biggest = max(sg.numel for sg in self.subgroups)
            parts.append(f"{format_bytes(pipeline)} for the optimizer's NVMe pipeline (three sub-groups of up to "
                         f"{biggest} elements)")
            # the smallest sub-group plan_subgroups makes (int8 block exponents: at most one byte an element)
            smallest = self._pipeline([ALIGN_NUMEL * self.layout.dtype(n).itemsize for n in self.layout.names],
                                      ALIGN_NUMEL)
            if biggest > ALIGN_NUMEL and params + smallest <= pool:
                fixes.append(f"lower offload.sub_group_numel (now {cfg.sub_group_numel})")
        if params:
            parts.append(f"{format_bytes(params)} for the parameter shards on NVMe (the largest group's block for a "
                         "gather and one read ahead, the largest trained group's twice for its update)")
            if pipeline <= pool:
                fixes.append('keep the parameters in host memory (offload.params: "cpu") if it has room')
        return (f"zinf offload: offload.pinned_pool_bytes = {pool} is too small for this model: staging needs {need} "
                f"bytes ({'; '.join(parts)}). {', or '.join(fixes)}.")

    def stages_like_one_group(self, groups: Sequence["FlatParamGroup"]) -> bool:
        """Whether gathering ``groups`` at once (a unit, see [Note: blocks as units] in zinf/schedule/units.py)
        stages no more in the pinned pool than the largest single group does, which is what ``check`` keeps room
        for. Not a share of a larger pool: the gathers ahead (``overlap.prefetch_modules`` units) hold their slots
        until their modules run and cannot be evicted, so units sized to the pool's free room wait on each other
        until the fetch times out (measured: 8 blocks of 1.38 MiB in a 4 MiB pool)."""
        return sum(self.staged_bytes(g) for g in groups) <= self.largest_staged
