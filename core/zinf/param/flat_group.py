"""A flat group: the parameters one module owns, flattened, padded and split 1/world across ranks.

[Note: flat layout]
The group's parameters are laid end to end in registration order (no per-parameter padding); the
flat vector is padded at the end to a multiple of ``world`` and rank ``r`` keeps elements
``[r * shard_numel, (r + 1) * shard_numel)``. An all-gather into one buffer of ``world *
shard_numel`` elements therefore rebuilds the flat vector with no copy, and each parameter's
``.data`` becomes a view of it. Gradients use the same layout, so a reduce-scatter of the flat
gradient lands each rank's slice in its gradient shard.

[Note: releasing memory]
Released parameters get ``.data`` set to a placeholder: one NaN element expanded (stride 0) to the
parameter's shape. ``shape``, ``dim()`` and ``numel()`` stay true for code that inspects parameters
(optimizer grouping, parameter counts), an in-place write raises, and a stray read yields NaN instead of
silently wrong numbers or freed memory. The full buffer's storage is resized to 0. Autograd may have saved views
of the full buffer (``weight.t()`` in a linear layer); resizing the shared storage frees those too,
and the next gather resizes it back, so the saved views read the gathered values again in backward.

[Note: frozen groups]
A group whose parameters are all frozen (``requires_grad=False``) when the engine is built trains nothing, so
it keeps one copy of its values: the parameter shard, at its storage width, on its tier (device, CPU or
NVMe). ``drop_master`` (the engine, before the placement) frees its fp32 master (with fp32 storage the
master *is* the shard, so nothing is freed and nothing extra was kept); it has no gradient shard memory, the
offloaded optimizer gives it no sub-groups (no state records, no swap I/O, not waited for by the next
gather), and a torch optimizer holding its parameters gets placeholders it never steps. Whatever reads a
master reads the shard widened to fp32 (``read_master``: exact, the shard is the value), and whatever writes
one (``write_master``, an edit written back by ``GatheredParameters``) narrows it into the shard. A group with
trainable and frozen parameters (one module) keeps its master for all of them, as before: the frozen elements
are gaps the optimizer copies unchanged. A later engine on the same (unplaced) model whose parameters train
again gets the master back, widened from the shard (``restore_master``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from zinf.runtime.comm import Comm
from zinf.param.state import GroupState
from zinf.runtime.gather_batch import GatherBatch
from zinf.runtime.staging import mark_device
from zinf.runtime.streams import InFlight, region, streams_for
from zinf.param.fence import UpdateFence
from zinf.param.grad_shard import GradShard
from zinf.param.store import DEVICE_STORE, ShardStore

__all__ = ["GroupState", "FlatParamGroup", "ParamSlot", "MasterHome"]

_NO_FENCE = UpdateFence()


class MasterHome(Protocol):
    """Where fp32 master shards live when they are not kept in the group (an offloaded optimizer's state)."""

    def read_master(self, group: "FlatParamGroup") -> torch.Tensor: ...
    def write_master(self, group: "FlatParamGroup", master: torch.Tensor) -> None: ...


class ShardSpill(ShardStore, Protocol):
    """Where ``zinf.Init`` keeps shards built for NVMe until the engine's placement takes them (see [Note:
    construction spill] in zinf/offload/spill_store.py)."""

    path: str  # the file, whose disk space comes back as the placement takes the shards
    in_place: bool  # loaders may leave shards where checkpoint files hold them (see [Note: frozen shards in place])

    def add(self, group: "FlatParamGroup", shard: torch.Tensor | None) -> None: ...
    def take(self, group: "FlatParamGroup") -> torch.Tensor: ...
    def in_place_record(self, group: "FlatParamGroup") -> Any: ...
    def take_in_place(self, group: "FlatParamGroup") -> Any: ...
    def keep_in_place(self, group: "FlatParamGroup", record: Any) -> None: ...


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat vector."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    dtype: torch.dtype = torch.float32  # the parameter's dtype as the model built it (a fill draws at it)


class FlatParamGroup:
    """The unit of gathering, reduce-scattering and optimizer stepping. See [Note: flat layout]."""

    def __init__(
        self,
        name: str,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        comm: Comm,
        compute_dtype: torch.dtype,
        device: torch.device,
        full_values: Sequence[torch.Tensor] | None = None,
        storage_dtype: torch.dtype | None = None,
        placeholders: bool = False,
    ) -> None:
        if not params:
            raise ValueError("a flat group needs at least one parameter")
        self.name = name
        self.comm = comm
        # weak: a parameter dropped from the model (a weight replaced by a tied one) must not be kept
        # alive by its group, nor keep the group (and its shard) alive through the registry
        self._param_refs = [weakref.ref(p) for p in params]
        self.compute_dtype = compute_dtype
        # [Note: storage dtype] the parameter shard at rest (every tier) may be narrower than the compute dtype
        # (``param_storage``): the all-gather moves the narrow bytes, then one cast widens the gathered vector
        self.storage_dtype = storage_dtype or compute_dtype
        self.device = device
        slots, offset = [], 0
        values = list(full_values) if full_values is not None else [p.detach() for p in params]
        for n, v in zip(names, values):
            slots.append(ParamSlot(name=n, shape=v.shape, offset=offset, numel=v.numel(), dtype=v.dtype))
            offset += v.numel()
        self.slots: list[ParamSlot] = slots
        self.numel = offset
        self.shard_numel = max(1, math.ceil(offset / comm.world))
        self.padded_numel = self.shard_numel * comm.world
        self.refresh_requires_grad(params)
        self.persistent = False
        self.state = GroupState.SHARDED
        self.holds = 0
        self.backward_held = False
        self._work: Any = None
        nan = torch.full((1,), float("nan"), dtype=compute_dtype, device=device)
        self._placeholders = [nan.as_strided(tuple(s.shape), (0,) * len(s.shape)) for s in self.slots]
        self._slot_of = {id(p): i for i, p in enumerate(params)}

        # The fp32 master shard is cut from the original (full precision) values, then cast. ``placeholders``:
        # values a loader replaces, in a shard that goes straight to NVMe with none of them (``spill_to``): neither
        # is made (the master and the cast would cost passes over the whole model for nothing)
        lo = comm.rank * self.shard_numel
        master: torch.Tensor | None = None
        if not placeholders:
            master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            for slot, v in zip(slots, values):
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + self.shard_numel)
                if a < b:
                    master[a - lo : b - lo].copy_(v.reshape(-1)[a - slot.offset : b - slot.offset])
        # master / shard become None when an offload placement takes them (``place``), the master also when
        # the group is frozen (see [Note: frozen groups])
        self.master: torch.Tensor | None = master
        self.shard_only = False
        self.shard: torch.Tensor | None = (
            torch.empty(self.shard_numel, dtype=self.storage_dtype, device=device) if master is None
            else master if self.storage_dtype == torch.float32 else master.to(self.storage_dtype))
        # [Note: placement] built on the device tier; an offload placement moves the group once (``place``)
        self.store: ShardStore = DEVICE_STORE
        self._master_home: MasterHome | None = None
        self._spill: ShardSpill | None = None  # [Note: construction spill]: the shard waits there for the placement
        self._fence = _NO_FENCE
        self.placed = False
        # With one rank the shard is the whole flat vector: gathering is free (unless it must be widened).
        if comm.world == 1 and self.storage_dtype == compute_dtype:
            self.full = self.shard
        else:
            self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
            self.full.untyped_storage().resize_(0)
        mark_device(self.master, self.shard, self.full)  # [Note: staged device] in zinf/runtime/staging.py
        self._widen_from: torch.Tensor | None = None  # the gathered narrow vector finish_gather widens
        self.grad = GradShard(self, [self.local_range(i) for i in range(len(self.slots))], device)
        self._grad_full: torch.Tensor | None = None
        self._arrived: set[int] = set()  # slots whose gradient arrived since the last reduce
        # [Note: stepped parameters] which slots produced a gradient since the last optimizer step: on this
        # rank until the end of a backward, then (several ranks) on any rank; the optimizer steps only these
        self.grad_used = torch.zeros(len(self.slots), dtype=torch.bool)
        self.reported_ready = False  # this rank's gradients of the group were announced to the other ranks
        self._to_placeholders()

    def use_comm(self, comm: Comm) -> None:
        """Run this group's collectives through ``comm`` from now on: the engine's group of the same ranks, with the
        transports it set up (a group made under ``zinf.Init`` holds the group it was built with)."""
        if (comm.rank, comm.world) != (self.comm.rank, self.comm.world):
            raise ValueError(f"{self.name}: built as rank {self.comm.rank} of {self.comm.world}, handed rank "
                             f"{comm.rank} of {comm.world}; build the model and the engine in the same process group")
        self.comm = comm

    def refresh_requires_grad(self, params: Sequence[nn.Parameter | None] | None = None) -> None:
        """Take the parameters' ``requires_grad`` as it is now (frozen after construction, before the engine)."""
        params = self.params if params is None else params
        self.requires_grad = [p is not None and p.requires_grad for p in params]
        self.num_grad_params = sum(self.requires_grad)

    def requires_grad_changed(self) -> str | None:
        """The name of a parameter whose ``requires_grad`` differs from what the engine was built with."""
        for p, slot, flag in zip(self.params, self.slots, self.requires_grad):
            if p is not None and p.requires_grad != flag:
                return slot.name
        return None

    @property
    def params(self) -> list[nn.Parameter | None]:
        """The group's parameters in slot order; None where a parameter no longer exists."""
        return [r() for r in self._param_refs]

    def place(self, store: ShardStore, grad: GradShard, fence: UpdateFence, master_home: MasterHome | None) -> None:
        """[Note: placement] Move the group to an offload placement, once: ``store`` takes its parameter shard
        (see ``hand_over_shard``), ``grad`` is its gradient shard there, ``fence`` tells whether a background
        step is still producing its new shard, and ``master_home`` (when the optimizer is offloaded) holds its
        fp32 master. The group is built on the device tier (by zinf.Init, before any engine exists), so this is
        the one transition its placement makes."""
        if self.placed:
            raise RuntimeError(f"zinf: {self.name} is already placed by another engine; build a new model for a "
                               "second engine with offload, or close() the first and rebuild the model.")
        self.store, self.grad, self._fence, self._master_home, self.placed = store, grad, fence, master_home, True

    def hand_over_shard(self) -> torch.Tensor:
        """Give the parameter shard to the store that keeps it from now on (the group no longer holds it)."""
        assert self.state is GroupState.SHARDED, f"{self.name}: hand_over_shard from {self.state}"
        if self.shard is None and self._spill is not None:  # built straight to NVMe: read back, one group at a time
            shard, self._spill = self._spill.take(self), None
            return shard
        assert self.shard is not None, f"{self.name}: no shard to hand over"
        self._separate_full()  # one rank gathers into the shard itself; from now on into a buffer of its own
        shard, self.shard = self.shard, None
        return shard

    def spill_to(self, spill: ShardSpill, placeholders: bool) -> None:
        """[Note: construction spill] in zinf/offload/spill_store.py: built under ``zinf.Init`` for NVMe, the shard
        goes to ``spill`` now and its memory is freed; so does the fp32 master where the shard holds the values
        exactly (fp32 storage, or 16-bit values), or where the values are ``placeholders`` a loader replaces."""
        assert self.state is GroupState.SHARDED and not self.placed and self.shard is not None, f"{self.name}: spill_to"
        self._separate_full()
        shard, self.shard = self.shard, None
        exact = placeholders or self.master is None or torch.equal(shard.to(torch.float32), self.master)
        spill.add(self, None if placeholders else shard)
        self.store, self._spill = spill, spill
        if exact:
            self.master, self.shard_only = None, True

    @property
    def in_place_record(self) -> Any:
        """Where the shard lies in checkpoint files while it waits in the construction spill, if it was loaded so: an
        ``InPlaceRecord``, opaque here (see [Note: frozen shards in place] in zinf/offload/in_place.py)."""
        return self._spill.in_place_record(self) if self._spill is not None and self.shard is None else None

    @property
    def loads_in_place(self) -> bool:
        """A loader may leave the shard where a checkpoint file holds it (see [Note: frozen shards in place])."""
        return (self._spill is not None and self.shard is None and not self.persistent
                and self._spill.in_place)

    def keep_in_place(self, record: Any) -> None:
        """The shard's values are the bytes ``record`` names in checkpoint files (read once, for the checksum;
        nothing is written)."""
        assert self.loads_in_place and self.master is None, f"{self.name}: keep_in_place"
        assert self._spill is not None
        self._spill.keep_in_place(self, record)

    def hand_over_in_place(self) -> Any:
        """Give the store the shard's place in the checkpoint files instead of the shard (nothing is read)."""
        assert self.state is GroupState.SHARDED and self._spill is not None, f"{self.name}: hand_over_in_place"
        record, self._spill = self._spill.take_in_place(self), None
        return record

    @property
    def spill_path(self) -> str | None:
        """The construction spill file the shard waits in for the placement, if it does."""
        return self._spill.path if self._spill is not None else None

    def unspill(self) -> None:
        """The placement keeps shards on the device tier: a shard built straight to NVMe comes back into the group."""
        if self._spill is not None and self.shard is None:
            self.shard = self.hand_over_shard()
            self.store = DEVICE_STORE

    def hand_over_master(self) -> torch.Tensor:
        """Give the fp32 master shard to the offloaded optimizer's state (the group no longer holds it). A group
        built straight to NVMe whose shard holds its values exactly makes it now, from the shard its store took
        (see [Note: construction spill])."""
        if self.master is None and self.shard_only and self.trainable:
            self.restore_master(torch.device("cpu"))  # for the offloaded optimizer's host (or NVMe) state
        assert self.master is not None, f"{self.name}: no master to hand over"
        master, self.master = self.master, None
        return master

    def fit_master(self) -> None:
        """At engine build, after ``refresh_requires_grad``: a group that trains nothing drops its fp32 master, a
        frozen one that trains again gets it back (see [Note: frozen groups]). A group an earlier engine placed
        is left as it is: a new engine with offload refuses it (``place``)."""
        if self.placed:
            return
        if not self.trainable and not self.shard_only:
            self.drop_master()
        elif self.trainable and self.shard_only and self._spill is None:
            self.restore_master()
        # built straight to NVMe: the master is made when the placement takes the group (``hand_over_master``,
        # ``restore_master``), one group at a time (see [Note: construction spill])

    def drop_master(self) -> None:
        """[Note: frozen groups] The engine is built and no parameter of the group trains: free the fp32 master
        (the shard alone is the group's value from now on)."""
        assert not self.trainable and not self.shard_only and not self.placed, f"{self.name}: drop_master"
        self.master, self.shard_only = None, True

    def restore_master(self, device: torch.device | None = None) -> None:
        """[Note: frozen groups] A frozen group trains again under a new engine: its fp32 master is widened from
        its shard (the frozen values are exactly the shard's), on ``device`` (default: the group's, where a
        device-tier optimizer steps it)."""
        assert self.trainable and self.shard_only, f"{self.name}: restore_master"
        # the store's shard (the group's own on the device tier, the spill's or the placement's store when built straight
        # to NVMe, read into host memory): an fp32 shard is the master itself, a 16-bit one is widened
        self.master, self.shard_only = self.store.read(self).to(device or self.device, torch.float32), False

    def expect_exact_values(self) -> None:
        """Built straight to NVMe, the group is about to get values its storage dtype holds exactly (a checkpoint at
        the storage width): a master kept for initial values it could not hold goes (see [Note: construction
        spill]); the placement makes one from the shard if the group trains."""
        if self._spill is not None and self.master is not None and not self.placed:
            self.master, self.shard_only = None, True

    def _keep_inexact_master(self, values: torch.Tensor) -> None:
        """Before the placement, a group built straight to NVMe whose new values the storage dtype cannot hold
        exactly keeps them as its master again (see [Note: construction spill]); a frozen group's are its shard's."""
        if self._spill is not None and not torch.equal(values.to(self.storage_dtype).to(torch.float32), values.float()):
            self.master, self.shard_only = values.to(self.device, torch.float32, copy=True), False

    def make_persistent(self) -> None:
        """Small groups stay gathered for the whole run (``overlap.persistent_numel``)."""
        self.persistent = True
        self.to_gathered()

    @property
    def update_pending(self) -> bool:
        """A background optimizer step has not yet produced this group's new shard."""
        return self._fence.pending(self)

    def zero_grad(self, memory_zeroed: bool = False) -> None:
        self.grad_used.zero_()
        self.grad.zero(memory_zeroed)

    # -- the fp32 master ------------------------------------------------------------------------
    def read_master(self) -> torch.Tensor:
        """This rank's fp32 master shard (read back from the optimizer's tier when offloaded; a frozen group's
        shard widened to fp32, see [Note: frozen groups])."""
        if self.master is not None:
            return self.master
        if self.shard_only:
            return self.store.read(self).to(torch.float32)
        assert self._master_home is not None, f"{self.name}: no master shard"
        return self._master_home.read_master(self)

    def write_master(self, master: torch.Tensor) -> None:
        """Replace this rank's master shard and the parameter shard derived from it (a frozen group's shard)."""
        with torch.no_grad():
            if self.master is not None:
                self.master.copy_(master)
                self.refresh_shard_from_master()
            else:
                if not self.shard_only:
                    assert self._master_home is not None
                    self._master_home.write_master(self, master)
                else:
                    self._keep_inexact_master(master)
                self.store.writer(self).copy_(master)
                self.store.commit(self)
            self._regather_if_persistent()

    def write_shard(self, fill: "Callable[[torch.Tensor], None]") -> None:
        """Replace the parameter shard of a group whose shard is its only copy (``shard_only``: frozen, or built
        straight to NVMe) by ``fill`` writing this rank's values at the storage width into the store's buffer: a
        checkpoint in that dtype is loaded without widening, narrowing or comparing (see
        [Note: reading at the storage width] in zinf/checkpoint/pretrained.py)."""
        assert self.shard_only and self.master is None, f"{self.name}: write_shard on a group with a master"
        with torch.no_grad():
            fill(self.store.writer(self))
            self.store.commit(self)
            self._regather_if_persistent()

    def _regather_if_persistent(self) -> None:
        """A persistent group gathered into a buffer of its own reads its changed shard again."""
        if self.persistent and self.owns_full:
            self.to_sharded()
            self.to_gathered()

    # -- parameter state transitions ------------------------------------------------------------
    @property
    def owns_full(self) -> bool:
        """False when one rank gathers in place: the full buffer is the shard itself."""
        return self.shard is None or self.full.data_ptr() != self.shard.data_ptr()

    @property
    def nbytes_full(self) -> int:
        return self.padded_numel * self.full.element_size()

    def start_gather(self, batch: GatherBatch | None = None) -> None:
        """Issue the all-gather on the all_gather stream (see [Note: streams] in zinf/runtime/streams.py): the full
        buffer is allocated on compute, and the stream waits for compute and for the store's copy-in (``fetch``
        makes it wait for its H2D fence) first. The shard is kept (in ``_work``) until compute has waited. With a
        ``batch`` the gather joins the round's one collective instead ([Note: one collective per round])."""
        assert self.state is GroupState.SHARDED, f"{self.name}: start_gather from {self.state}"
        self._fence.wait(self)
        if self.owns_full:
            self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        streams = streams_for(self.device)
        source = self.store.fetch(self)
        # [Note: storage dtype] a narrow shard is gathered into a narrow buffer (allocated here, on compute), or with
        # one rank read as it is; finish_gather widens it into the full buffer
        if self.storage_dtype == self.compute_dtype:
            gathered = self.full
        elif self.comm.world == 1:
            gathered = source
        else:
            gathered = torch.empty(self.padded_numel, dtype=self.storage_dtype, device=self.device)
        if batch is not None and gathered is not source:
            self._work = batch.start(gathered, source, (source, gathered))
        elif not self.owns_full:  # one rank, the shard in device memory: nothing moves, nothing to order
            self._work = None
        else:
            with region("all_gather", self.name):
                streams.all_gather.wait_stream(streams.current())
                with streams.use(streams.all_gather):
                    work = None if gathered is source else self.comm.all_gather_into(gathered, source, async_op=True)
            self._work = InFlight(streams, streams.all_gather, work, (source, gathered))
        self._widen_from = None if gathered is self.full else gathered
        self.state = GroupState.GATHERING

    def finish_gather(self) -> None:
        """Compute waits for the all-gather's event before the parameters point at the full buffer."""
        assert self.state is GroupState.GATHERING, f"{self.name}: finish_gather from {self.state}"
        if self._work is not None:
            self._work.join()
            self._work = None
        if self._widen_from is not None:  # before done(): with one rank it is the store's buffer itself
            self.full.copy_(self._widen_from)
            self._widen_from = None
        self.store.done(self)
        for p, slot in zip(self.params, self.slots):
            if p is not None:
                p.data = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        self.state = GroupState.GATHERED

    def serve_gather(self, batch: GatherBatch | None = None) -> None:
        """Another rank gathers this group while this rank has it gathered (or gathering): take part in the
        collective with this rank's slice, into a scratch buffer (see [Note: rounds] in zinf/schedule/rounds.py);
        with a ``batch``, as a part of the round's one collective."""
        if self.state is GroupState.GATHERING:
            self.finish_gather()
        assert self.state is GroupState.GATHERED, f"{self.name}: serve_gather from {self.state}"
        lo = self.comm.rank * self.shard_numel
        streams = streams_for(self.device)
        with region("all_gather", self.name):
            scratch = torch.empty(self.padded_numel, dtype=self.storage_dtype, device=self.device)  # on compute
            # exact: widened from it. With a batch always a copy: the batch reads it after this call returns, and
            # the full buffer may be resharded (its storage freed) before that
            mine = self.full[lo : lo + self.shard_numel].to(self.storage_dtype, copy=batch is not None)
            if batch is not None:
                batch.serve(scratch, mine)
                return
            streams.all_gather.wait_stream(streams.current())
            with streams.use(streams.all_gather):
                self.comm.all_gather_into(scratch, mine, async_op=False)
            # compute waits before it drops the scratch it allocated (and before it may reshard the full buffer)
            InFlight(streams, streams.all_gather, None, (scratch,)).join()

    def to_gathered(self) -> None:
        if self.state is GroupState.SHARDED:
            self.start_gather()
        if self.state is GroupState.GATHERING:
            self.finish_gather()

    def to_sharded(self) -> None:
        assert self.state is GroupState.GATHERED, f"{self.name}: to_sharded from {self.state}"
        self._to_placeholders()
        if self.owns_full:
            self.full.untyped_storage().resize_(0)
        self.state = GroupState.SHARDED

    def acquire(self) -> None:
        """Take a hold: the group is gathered (waiting for an in-flight gather) until the last release.
        A group that stays gathered (persistent, or one rank gathering in place) is read without a new
        gather, so a pending background update must be waited for here too."""
        self._fence.wait(self)
        self.to_gathered()
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

    def report_ready(self) -> bool:
        """Mark this rank's gradients of the group as announced to the other ranks; False if they already were."""
        first, self.reported_ready = not self.reported_ready, True
        return first

    def maybe_shard(self) -> None:
        if self.holds == 0 and not self.backward_held and not self.persistent and self.state is GroupState.GATHERED:
            self.to_sharded()

    def _to_placeholders(self) -> None:
        for p, placeholder in zip(self.params, self._placeholders):
            if p is not None:
                p.data = placeholder

    def write_back(self) -> None:
        """Copy this rank's slice of the gathered values into the shard and master (after an edit; a frozen
        group has no master)."""
        assert self.state is GroupState.GATHERED, f"{self.name}: write_back from {self.state}"
        lo = self.comm.rank * self.shard_numel
        mine = self.full[lo : lo + self.shard_numel]
        if self.shard is None or self.full.data_ptr() != self.shard.data_ptr():
            self.store.writer(self).copy_(mine)
            self.store.commit(self)
        if self.shard_only:  # the shard is its only copy (see [Note: frozen groups])
            self._keep_inexact_master(mine)
            return
        if self.master is None:
            assert self._master_home is not None
            self._master_home.write_master(self, mine.to(torch.float32))
        elif self.shard is None or self.master.data_ptr() != self.shard.data_ptr():
            self.master.copy_(mine)

    def gather_master_full(self, master: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's fp32 master (``master``: this rank's, read by the caller; else ``read_master()``),
        all-gathered into one flat vector."""
        local = master if master is not None else self.read_master()
        full = torch.empty(self.padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather_into(full, local.to(self.device), async_op=False)
        return full

    def _separate_full(self) -> None:
        """Give the group a gather buffer of its own (one rank normally gathers in place into the shard)."""
        if self.shard is not None and self.full.data_ptr() == self.shard.data_ptr():
            assert self.state is GroupState.SHARDED
            self.full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=self.device)
            self.full.untyped_storage().resize_(0)
            mark_device(self.full)

    def refresh_shard_from_master(self) -> None:
        """After a device-tier optimizer step: the compute-dtype shard follows the fp32 master."""
        assert self.master is not None
        if self.shard is not None and self.master.data_ptr() == self.shard.data_ptr():
            return
        self.store.writer(self).copy_(self.master)
        self.store.commit(self)

    # -- gradients ------------------------------------------------------------------------------
    def add_grad(self, param: nn.Parameter, grad: torch.Tensor, reduce_dtype: torch.dtype) -> bool:
        """Place one parameter's full gradient in the flat gradient; True once every one has arrived.

        With one rank the gradient shard is the whole flat vector, so the gradient is accumulated into
        it directly (the same 0 + g, then + g2, as through a flat buffer) and nothing is left to reduce, unless the
        shard is in host memory off the device (``off_device``): then it is reduced (a copy) and copied off as with
        several ranks (see [Note: gradient landing] in zinf/param/grad_shard.py)."""
        index = self.index_of(param)
        slot = self.slots[index]
        self.grad_used[index] = True
        if self.comm.world == 1 and not self.grad.off_device:
            self.grad.accumulating()[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1).to(self.grad.device))
        else:
            if self._grad_full is None:
                self._grad_full = torch.zeros(self.padded_numel, dtype=reduce_dtype, device=self.device)
                mark_device(self._grad_full)
            self._grad_full[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
        complete_before = len(self._arrived) == self.num_grad_params
        self._arrived.add(index)
        # a parameter's gradient can arrive twice in one backward (a re-entrant checkpoint runs a backward of
        # its own): the group completes once, and what comes later is reduced again at the end of backward
        return not complete_before and len(self._arrived) == self.num_grad_params

    @property
    def grad_buffer_bytes(self) -> int:
        """Bytes of the flat gradient being assembled (0 when none is)."""
        return 0 if self._grad_full is None else self._grad_full.numel() * self._grad_full.element_size()

    @property
    def has_pending_grads(self) -> bool:
        return bool(self._arrived)

    @property
    def trainable(self) -> bool:
        """Whether any parameter of the group requires a gradient (frozen groups have no gradient shard)."""
        return self.num_grad_params > 0

    def take_grad_full(self, reduce_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The flat gradient to reduce-scatter (None with one rank and the shard on the device: it is already in
        the shard). Zeros
        when this rank produced none this time but another rank did (its part of the sum is zero)."""
        full, self._grad_full = self._grad_full, None
        self._arrived = set()
        self.reported_ready = False
        if full is None and (self.comm.world > 1 or self.grad.off_device):
            full = torch.zeros(self.padded_numel, dtype=reduce_dtype, device=self.device)
        return full

    # -- per-parameter views of this rank's shard -----------------------------------------------
    def index_of(self, param: nn.Parameter) -> int:
        return self._slot_of[id(param)]

    def built_dtype_at(self, view: torch.Tensor) -> torch.dtype:
        """The built dtype of the parameter that ``view`` (of the gathered vector) starts in."""
        at = view.storage_offset() - self.full.storage_offset()
        for slot in self.slots:
            if slot.offset <= at < slot.offset + slot.numel:
                return slot.dtype
        return view.dtype

    def local_range(self, index: int) -> tuple[int, int]:
        """The part of parameter ``index`` held by this rank, as [start, end) into the shard."""
        slot, lo = self.slots[index], self.comm.rank * self.shard_numel
        a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + self.shard_numel)
        return (a - lo, b - lo) if a < b else (0, 0)

    def __repr__(self) -> str:
        return f"FlatParamGroup({self.name}, numel={self.numel}, shard={self.shard_numel}, {self.state.name})"
