"""The fp32 master of a group's shard on this rank: held by the group, held by an offloaded optimizer's state, or
none at all where the parameter shard is the value.

[Note: frozen groups]
A group whose parameters are all frozen (``requires_grad=False``) when the engine is built trains nothing, so
it keeps one copy of its values: the parameter shard, at its storage width, on its tier (device, CPU or
NVMe). ``drop`` (the engine, before the placement) frees its fp32 master (with fp32 storage the
master *is* the shard, so nothing is freed and nothing extra was kept); it has no gradient shard memory, the
offloaded optimizer gives it no sub-groups (no state records, no swap I/O, not waited for by the next
gather), and a torch optimizer holding its parameters gets placeholders it never steps. Whatever reads a
master reads the shard widened to fp32 (``read``: exact, the shard is the value), and whatever writes
one (``write``, an edit written back by ``GatheredParameters``) narrows it into the shard. A group with
trainable and frozen parameters (one module) keeps its master for all of them, as before: the frozen elements
are gaps the optimizer copies unchanged. A later engine on the same (unplaced) model whose parameters train
again gets the master back, widened from the shard (``restore``).
"""

from __future__ import annotations

import weakref
from typing import Protocol, Sequence

import torch

from zinf.param.keys import GroupKey
from zinf.param.layout import FlatLayout
from zinf.param.residence import ShardResidence

__all__ = ["MasterHome", "MasterShard"]


class MasterHome(Protocol):
    """Where fp32 master shards live when they are not kept in the group (an offloaded optimizer's state)."""

    def read_master(self, group: GroupKey) -> torch.Tensor: ...
    def write_master(self, group: GroupKey, master: torch.Tensor) -> None: ...


class MasterShard:
    """This rank's fp32 master of one group: ``tensor`` (held here), or with ``home`` (an offloaded optimizer's
    state), or ``shard_only`` (no master: the parameter shard, where ``residence`` keeps it, is the value; see [Note:
    frozen groups]). ``group`` is the group it belongs to, as its store knows it."""

    def __init__(self, group: GroupKey, residence: ShardResidence, tensor: torch.Tensor | None) -> None:
        # weak: the group holds its master, not the reverse, so that a group is freed as soon as the registry lets
        # it go (its parameters freed), not at a later garbage collection (see ZeroInfinityEngine.close)
        self._group = weakref.ref(group)
        self.residence = residence
        self.tensor = tensor
        self.shard_only = False
        self.home: MasterHome | None = None

    @property
    def group(self) -> GroupKey:
        group = self._group()
        assert group is not None, "a master shard outlived its group"
        return group

    @staticmethod
    def cut(layout: FlatLayout, values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """This rank's fp32 master, cut from the parameters' original (full precision) values."""
        lo, n = layout.lo, layout.shard_numel
        master = torch.zeros(n, dtype=torch.float32, device=device)
        for slot, v in zip(layout.slots, values):
            a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + n)
            if a < b:
                master[a - lo : b - lo].copy_(v.reshape(-1)[a - slot.offset : b - slot.offset])
        return master

    def lives_with(self, home: MasterHome | None) -> None:
        """The placement's decision: with an offloaded optimizer, ``home`` (its state) keeps the master."""
        self.home = home

    def read(self) -> torch.Tensor:
        """The master (read back from the optimizer's tier when offloaded; the shard widened to fp32 when the shard
        is the value)."""
        if self.tensor is not None:
            return self.tensor
        if self.shard_only:
            return self.group.shard_values(self.residence.store.read(self.group))
        assert self.home is not None, f"{self.group.name}: no master shard"
        return self.home.read_master(self.group)

    def write(self, master: torch.Tensor) -> None:
        """Replace the master and the parameter shard derived from it (the shard alone where it is the value)."""
        if self.tensor is not None:
            self.tensor.copy_(master)
            self.refresh_shard()
            return
        if not self.shard_only:
            assert self.home is not None
            self.home.write_master(self.group, master)
        else:
            self._keep_inexact(master)
        store = self.residence.store
        store.writer(self.group).copy_(master)
        store.commit(self.group)

    def write_slice(self, mine: torch.Tensor) -> None:
        """This rank's slice of an edited, gathered vector (the parameter shard was written already)."""
        shard = self.group.shard
        if self.shard_only:  # the shard is its only copy
            self._keep_inexact(mine)
        elif self.tensor is None:
            assert self.home is not None
            self.home.write_master(self.group, mine.to(torch.float32))
        elif shard is None or self.tensor.data_ptr() != shard.data_ptr():
            self.tensor.copy_(mine)

    def refresh_shard(self) -> None:
        """After a device-tier optimizer step: the compute-dtype shard follows the fp32 master."""
        assert self.tensor is not None
        shard = self.group.shard
        if shard is not None and self.tensor.data_ptr() == shard.data_ptr():
            return
        self.residence.store.writer(self.group).copy_(self.tensor)
        self.residence.store.commit(self.group)

    def hand_over(self, trainable: bool) -> torch.Tensor:
        """Give the master to the offloaded optimizer's state (this object no longer holds it). A group built straight
        to NVMe whose shard holds its values exactly makes it now, from the shard its store took (see [Note:
        construction spill] in zinf/offload/spill_store.py)."""
        if self.tensor is None and self.shard_only and trainable:
            self.restore(torch.device("cpu"))  # for the offloaded optimizer's host (or NVMe) state
        assert self.tensor is not None, f"{self.group.name}: no master to hand over"
        master, self.tensor = self.tensor, None
        return master

    def fit(self, trainable: bool) -> None:
        """At engine build: a group that trains nothing drops its master, a frozen one that trains again gets it
        back. A group an earlier engine placed is left as it is (a new engine with offload refuses it); built straight
        to NVMe, the master is made when the placement takes the group, one group at a time."""
        if self.residence.placed:
            return
        if not trainable and not self.shard_only:
            self.drop()
        elif trainable and self.shard_only and not self.residence.spilled:
            self.restore(self.group.device)

    def drop(self) -> None:
        """The shard alone is the group's value from now on."""
        self.tensor, self.shard_only = None, True

    def restore(self, device: torch.device) -> None:
        """A frozen group trains again: its master is widened from its shard (the frozen values are exactly the
        shard's), on ``device``. The shard is the store's: the group's own on the device tier, the spill's or the
        placement's store when built straight to NVMe, read into host memory."""
        assert self.shard_only, f"{self.group.name}: restore_master"
        self.tensor, self.shard_only = self.group.shard_values(self.residence.store.read(self.group)).to(device), False

    def expect_exact_values(self) -> None:
        """Built straight to NVMe, the group is about to get values its storage dtype holds exactly (a checkpoint at
        the storage width): a master kept for initial values it could not hold goes; the placement makes one from
        the shard if the group trains."""
        if self.residence.spilled and self.tensor is not None and not self.residence.placed:
            self.drop()

    def _keep_inexact(self, values: torch.Tensor) -> None:
        """Before the placement, a group built straight to NVMe whose new values the storage dtype cannot hold
        exactly keeps them as its master again (see [Note: construction spill])."""
        if self.residence.spilled and not torch.equal(values.to(self.group.storage_dtype).to(torch.float32),
                                                      values.float()):
            self.tensor, self.shard_only = values.to(self.group.device, torch.float32, copy=True), False
