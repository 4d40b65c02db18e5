"""A flat group: the parameters one module owns, flattened, padded and split 1/world across ranks (see [Note: flat
layout] in zinf/param/layout.py). The group keeps the gather state machine (SHARDED -> GATHERING -> GATHERED), its
holds and its full buffer; its fp32 master (``master.py``), where its shard is kept (``residence.py``) and the flat
gradient a backward assembles (``grad_flat.py``) are objects of their own.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
from torch import nn

from zinf.device_memory import mark_device
from zinf.native.checksum import ContentCheck
from zinf.param.eight_bit import QuantizedFormat
from zinf.param.four_bit import WidenedShard, refuse_change
from zinf.param.grad_flat import FlatGrad
from zinf.param.grad_shard import GradShard
from zinf.param.layout import FlatLayout, ParamSlot
from zinf.param.master import MasterHome, MasterShard
from zinf.param.residence import ShardResidence, ShardSpill
from zinf.param.state import GroupState
from zinf.param.store import ShardStore, UpdateFence
from zinf.runtime import collectives
from zinf.runtime.collectives import GatherBatch
from zinf.runtime.context import RunContext
from zinf.runtime.streams import InFlight

__all__ = ["GroupState", "FlatParamGroup", "ParamSlot", "MasterHome", "ShardSpill"]


class FlatParamGroup:
    """The unit of gathering, reduce-scattering and optimizer stepping."""

    def __init__(self, name: str, params: Sequence[nn.Parameter], names: Sequence[str], rank: int, world: int,
                 compute_dtype: torch.dtype, device: torch.device, full_values: Sequence[torch.Tensor] | None = None,
                 storage_dtype: torch.dtype | None = None, placeholders: bool = False,
                 quantized: QuantizedFormat | None = None) -> None:
        if not params:
            raise ValueError("a flat group needs at least one parameter")
        self.name = name
        # weak: a parameter dropped from the model (a weight replaced by a tied one) must not be kept
        # alive by its group, nor keep the group (and its shard) alive through the registry
        self._param_refs = [weakref.ref(p) for p in params]
        self.compute_dtype = compute_dtype
        # [Note: storage dtype] the parameter shard at rest (every tier) may be narrower than the compute dtype
        # (``param_storage``): the all-gather moves the narrow bytes, then one cast widens the gathered vector
        self.storage_dtype = torch.uint8 if quantized is not None else storage_dtype or compute_dtype
        # bitsandbytes' codes and scales ([Note: 4-bit shards] in four_bit.py, [Note: 8-bit shards] in eight_bit.py)
        self.quantized = quantized
        self.format = quantized or WidenedShard(self.storage_dtype)
        self.device = device
        values = list(full_values) if full_values is not None else [p.detach() for p in params]
        self.layout = FlatLayout.of(names, values, rank, world, align=self.format.align)
        self.slots, self.numel, self.rank, self.world = list(self.layout.slots), self.layout.numel, rank, world
        self.shard_numel, self.padded_numel = self.layout.shard_numel, self.layout.padded_numel
        self.persistent, self.state, self.holds, self.backward_held = False, GroupState.SHARDED, 0, False
        self._work: InFlight | None = None
        self._placeholders = self.layout.placeholders(compute_dtype, device)  # [Note: releasing memory]
        self._slot_of = {id(p): i for i, p in enumerate(params)}
        # ``placeholders``: values a loader replaces, in a shard that goes straight to NVMe with none of them
        # (``spill_to``): no master is cut and no shard cast (passes over the whole model for nothing)
        master = None if placeholders or quantized else MasterShard.cut(self.layout, values, device)
        self.shard: torch.Tensor | None = (
            quantized.encode(self.slots, values, self.layout.lo, self.shard_numel).to(device) if quantized and not placeholders
            else self.format.empty_shards(1, self.shard_numel, device) if master is None
            else master if self.storage_dtype == torch.float32 else master.to(self.storage_dtype))
        self.residence = ShardResidence()  # [Note: placement]: the device tier until a placement moves the shard
        # the master goes when an offload placement takes it, or when the group is frozen ([Note: frozen groups])
        self.master_shard = MasterShard(self, self.residence, master)
        if quantized:
            self.master_shard.drop()  # the codes are the value; nothing trains them
        # With one rank the shard is the whole flat vector: gathering is free (unless it must be widened).
        if world == 1 and self.storage_dtype == compute_dtype:
            self.full = self.shard
        else:
            self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
            self.full.untyped_storage().resize_(0)
        mark_device(master, self.shard, self.full)  # [Note: staged device] in zinf/device_memory.py
        self._widen_from: torch.Tensor | None = None  # the gathered narrow vector finish_gather widens
        self.grad = GradShard(self, [self.layout.local_range(i) for i in range(len(self.slots))], device)
        self.grad_in = FlatGrad(self.layout, device, params)  # the flat gradient a backward assembles
        self._to_placeholders()

    @property
    def params(self) -> list[nn.Parameter | None]:
        """The group's parameters in slot order; None where a parameter no longer exists."""
        return [r() for r in self._param_refs]

    @property
    def shard_nbytes(self) -> int:
        """Bytes of this rank's parameter shard at rest."""
        return self.format.nbytes(self.shard_numel)

    def shard_values(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard (as a store reads it) as fp32 values: widened, or decoded from 4 bits."""
        return self.format.values(shard, self.shard_numel)

    @property
    def trainable(self) -> bool:
        """Whether any parameter of the group requires a gradient (frozen groups have no gradient shard)."""
        return self.grad_in.num_trained > 0

    # -- where the shard and the master are ---------------------------------------------------------
    store = property(lambda self: self.residence.store, doc="The store that keeps the parameter shard.")
    master = property(lambda self: self.master_shard.tensor, doc="The fp32 master shard, or None (frozen, quantized).")
    shard_only = property(lambda self: self.master_shard.shard_only, doc="Whether the shard is the only copy.")

    def place(self, store: ShardStore, grad: GradShard, fence: UpdateFence, master_home: MasterHome | None,
              whole: bool = False) -> None:
        """[Note: placement] Move the group to an offload placement, once: ``store`` takes its parameter shard
        (see ``hand_over_shard``), ``grad`` is its gradient shard there, ``fence`` tells whether a background step
        is still producing its new shard, ``master_home`` (an offloaded optimizer's) holds its fp32 master. Built
        on the device tier (by zinf.Init), the group makes this one move; ``whole``: every rank's shard is read."""
        self.residence.place(self, store, fence, whole)
        self.grad = grad
        self.master_shard.lives_with(master_home)

    def hand_over_shard(self) -> torch.Tensor:
        """Give the parameter shard to the store that keeps it from now on (the group no longer holds it)."""
        assert self.state is GroupState.SHARDED, f"{self.name}: hand_over_shard from {self.state}"
        if self.shard is None and self.residence.spilled:  # built straight to NVMe: read back, a group at a time
            return self.residence.take_spilled(self)
        assert self.shard is not None, f"{self.name}: no shard to hand over"
        self._separate_full()  # one rank gathers into the shard itself; from now on into a buffer of its own
        shard, self.shard = self.shard, None
        return shard

    def spill_to(self, spill: ShardSpill, placeholders: bool) -> None:
        """[Note: construction spill] in zinf/offload/spill_store.py: built under ``zinf.Init`` for NVMe, the shard
        goes to ``spill`` now and its memory is freed; so does the fp32 master where the shard holds the values
        exactly (fp32 storage, or 16-bit values), or where the values are ``placeholders`` a loader replaces."""
        assert self.state is GroupState.SHARDED and not self.residence.placed and self.shard is not None, self.name
        self._separate_full()
        shard, self.shard = self.shard, None
        exact = placeholders or self.master is None or torch.equal(shard.to(torch.float32), self.master)
        self.residence.spill_to(self, spill, None if placeholders else shard)
        if exact:
            self.master_shard.drop()

    def unspill(self) -> None:
        """The placement keeps shards on the device tier: a shard built straight to NVMe comes back into the group."""
        if self.residence.spilled and self.shard is None:
            self.shard = self.hand_over_shard()
            self.residence.back_to_device()

    update_pending = property(lambda self: self.residence.fence.pending(self),
                              doc="A background optimizer step has not yet produced this group's new shard.")

    def write_master(self, master: torch.Tensor) -> None:
        """Replace this rank's master shard and the parameter shard derived from it (a frozen group's shard)."""
        if self.quantized is not None:  # a quantized group takes back its own values (a resume), nothing else
            return refuse_change(self, "loading other values into it", master)
        with torch.no_grad():
            self.master_shard.write(master)
            self._regather_if_persistent()

    def write_shard(self, fill: Callable[[torch.Tensor], None]) -> None:
        """Replace the parameter shard of a group whose shard is its only copy (``shard_only``: frozen, or built
        straight to NVMe) by ``fill`` writing this rank's values at the storage width into the store's buffer: a
        checkpoint in that dtype is loaded without widening, narrowing or comparing (see
        [Note: reading at the storage width] in zinf/checkpoint/pretrained.py)."""
        assert self.shard_only and self.master is None, f"{self.name}: write_shard on a group with a master"
        refuse_change(self, "loading values into it")
        with torch.no_grad():
            self.residence.write(self, fill)
            self._regather_if_persistent()

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered values into the shard and master (after an edit; a frozen
        group has no master)."""
        assert self.state is GroupState.GATHERED, f"{self.name}: write_back from {self.state}"
        mine = self.full[self.layout.lo : self.layout.lo + self.shard_numel]
        if self.quantized is not None:
            return refuse_change(self, "an edit of its gathered values", mine)
        if self.shard is None or self.full.data_ptr() != self.shard.data_ptr():
            self.residence.write(self, lambda out: out.copy_(mine))
        self.master_shard.write_slice(mine)

    # -- the gather state machine -----------------------------------------------------------------
    def make_persistent(self, ctx: RunContext) -> None:
        """Small groups stay gathered for the whole run (``overlap.persistent_numel``)."""
        self.persistent = True
        self.to_gathered(ctx)

    def _regather_if_persistent(self) -> None:
        """A persistent group gathered into a buffer of its own reads its changed shard again: it goes back to its
        shard now and is gathered at its next use (``acquire``), which hands the gather its context."""
        if self.persistent and self.owns_full and self.state is GroupState.GATHERED:
            self.to_sharded()

    @property
    def owns_full(self) -> bool:
        """False when one rank gathers in place: the full buffer is the shard itself."""
        return self.shard is None or self.full.data_ptr() != self.shard.data_ptr()

    @property
    def nbytes_full(self) -> int:
        return self.full.numel() * self.full.element_size()  # the flat vector, or a packed one's shards end to end

    def start_gather(self, ctx: RunContext, batch: GatherBatch | None = None) -> None:
        """Issue the all-gather (``collectives.all_gather``): the full buffer is allocated here, on compute, after the
        store's copy-in (``fetch``). The shard is kept (in ``_work``) until compute has waited. With a ``batch`` the
        gather joins the round's one collective instead ([Note: one collective per round])."""
        assert self.state is GroupState.SHARDED, f"{self.name}: start_gather from {self.state}"
        self.residence.fence.wait(self)
        if self.owns_full:  # [Note: gather buffer cache] in zinf/native/buffer_cache.py
            ctx.resize(self.full.untyped_storage(), self.nbytes_full, self.trainable)
        # [Note: storage dtype] a narrow shard is gathered narrow (or read as it is) and widened by finish_gather; one
        # widened from the store's buffer with its checksum (read whole, one rank) is widened here (_widen_checked)
        into_full = self.storage_dtype == self.full.dtype or (self.quantized is None and ctx.comm.gathers_widening(self.full))
        widen_here = self.quantized is None and (self.residence.whole or (self.world == 1 and not into_full))
        source, check = self.store.fetch(self, defer_check=widen_here), self.store.take_check(self) if widen_here else None
        if check is not None:
            _widen_checked(self, source, check)
        if self.residence.whole:  # every rank's shard, read here: no collective ([Note: frozen groups read whole])
            self._work = collectives.all_gather(ctx, source, source, self.name)  # ordered: waits for its copy-in
            self._widen_from, self.state = None if check is not None else source, GroupState.GATHERING
            return
        gathered = self.full if into_full else source if self.world == 1 else self.format.empty_shards(  # [Note: a widening gather]
            self.world, self.shard_numel, self.device, ctx.empty_for(self.trainable))
        # one rank, the shard in device memory: nothing moves, nothing to order
        self._work = collectives.all_gather(ctx, gathered, source, self.name, batch) if self.owns_full else None
        self._widen_from = None if gathered is self.full or check is not None else gathered
        self.state = GroupState.GATHERING

    def finish_gather(self) -> None:
        """Compute waits for the all-gather's event before the parameters point at the full buffer."""
        assert self.state is GroupState.GATHERING, f"{self.name}: finish_gather from {self.state}"
        work, self._work = self._work, None
        # a batch's first join made compute wait for the whole batch: the others have nothing left to wait for
        if work is not None and (work.shared is None or work.shared.joined is None):
            work.join()
        if self._widen_from is not None:  # before done(): with one rank it is the store's buffer itself
            if self.full.dtype == self._widen_from.dtype:  # kept narrow (keep_narrow)
                self.full.copy_(self._widen_from)
            else:
                self.format.widen(self._widen_from, self.world, self.shard_numel, self.full)
            self._widen_from = None
        self.store.done(self)
        for p, slot in zip(self.params, self.slots):
            if p is not None and not self.packed:  # packed codes are read by the layer (zinf/frozen_linear.py)
                p.data = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self.state = GroupState.GATHERED

    def serve_gather(self, ctx: RunContext, batch: GatherBatch | None = None) -> None:
        """Another rank gathers this group while this rank has it gathered (or gathering): take part in the
        collective with this rank's slice, into a scratch buffer (see [Note: rounds] in zinf/schedule/rounds.py);
        with a ``batch``, as a part of the round's one collective."""
        if self.state is GroupState.GATHERING:
            self.finish_gather()
        assert self.state is GroupState.GATHERED, f"{self.name}: serve_gather from {self.state}"
        lo = self.rank * self.shard_numel
        scratch = self.format.empty_shards(self.world, self.shard_numel, self.device, ctx.empty_for(self.trainable))
        # exact: widened from it. With a batch always a copy: the batch reads it after this call returns, and the full
        # buffer may be resharded (its storage freed) before that. 4-bit codes are not cut from decoded values: the
        # store's shard is sent
        mine = (self.store.read(self).to(self.device, copy=True) if self.quantized is not None
                else self.full[lo : lo + self.shard_numel].to(self.storage_dtype, copy=batch is not None))
        collectives.serve_all_gather(ctx, scratch, mine, self.name, batch)

    def to_gathered(self, ctx: RunContext) -> None:
        if self.state is GroupState.SHARDED:
            self.start_gather(ctx)
        if self.state is GroupState.GATHERING:
            self.finish_gather()

    def to_sharded(self) -> None:
        assert self.state is GroupState.GATHERED, f"{self.name}: to_sharded from {self.state}"
        self._to_placeholders()
        if self.owns_full:
            self.full.untyped_storage().resize_(0)
        self.state = GroupState.SHARDED

    def acquire(self, ctx: RunContext) -> None:
        """Take a hold: the group is gathered (waiting for an in-flight gather) until the last release.
        A group that stays gathered (persistent, or one rank gathering in place) is read without a new
        gather, so a pending background update must be waited for here too."""
        self.residence.fence.wait(self)
        self.to_gathered(ctx)
        self.holds += 1

    def release(self) -> None:
        """Drop a hold; the last one returns the group to SHARDED unless it is persistent or held for backward."""
        assert self.holds > 0, f"{self.name}: release without a hold"
        self.holds -= 1
        self.maybe_shard()

    def hold_for_backward(self) -> None:
        """The backward gathered the group: it stays gathered until its gradients are complete."""
        self.backward_held = True

    def drop_backward_hold(self) -> bool:
        """Its gradients are complete: True if the backward held it (the caller releases the fetcher's hold)."""
        held, self.backward_held = self.backward_held, False
        return held

    def maybe_shard(self) -> None:
        if self.holds == 0 and not self.backward_held and not self.persistent and self.state is GroupState.GATHERED:
            self.to_sharded()

    def _to_placeholders(self) -> None:
        for p, placeholder in zip(self.params, self._placeholders):
            if p is not None:
                p.data = placeholder

    def _separate_full(self, dtype: torch.dtype | None = None, numel: int = 0) -> None:
        """A gather buffer of its own (one rank gathers in place into the shard), of ``dtype`` (``keep_narrow``)."""
        if dtype is not None or (self.shard is not None and self.full.data_ptr() == self.shard.data_ptr()):
            assert self.state is GroupState.SHARDED
            self.full = torch.empty(numel or self.padded_numel, dtype=dtype or self.full.dtype, device=self.device)
            self.full.untyped_storage().resize_(0)
            mark_device(self.full)

    def keep_narrow(self, narrow: bool = True) -> None:
        """Gather at the storage width, not widened ([Note: frozen linears from storage] in zinf/frozen_linear.py); a
        quantized group's shards end to end, ``packed``: its parameters stay placeholders while it is gathered."""
        packed = self.world * self.format.nbytes(self.shard_numel) if narrow and self.quantized else 0
        self._separate_full(self.storage_dtype if narrow else self.compute_dtype, packed)

    packed = property(lambda self: self.quantized is not None and self.full.dtype == torch.uint8)

    # -- gradients and slots ----------------------------------------------------------------------
    def zero_grad(self, memory_zeroed: bool = False) -> None:
        self.grad_in.used.zero_()
        self.grad.zero(memory_zeroed)

    def index_of(self, param: nn.Parameter) -> int: return self._slot_of[id(param)]  # noqa: E704

    def __repr__(self) -> str:
        return f"FlatParamGroup({self.name}, numel={self.numel}, shard={self.shard_numel}, {self.state.name})"


def _widen_checked(group: FlatParamGroup, source: torch.Tensor, check: ContentCheck) -> None:
    """A frozen shard's values widened from the store's own buffer (``source``) into ``group.full``, its checksum
    taken in that copy and verified ([Note: one pass per byte] in zinf/offload/in_place.py), before the group leaves
    SHARDED: a refused shard frees the full buffer again and unwinds as a failed read does."""
    try:
        group.format.widen(source, group.world, group.shard_numel, group.full, check)
    except BaseException:
        group.full.untyped_storage().resize_(0)
        raise
