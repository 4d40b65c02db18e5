"""Where a group's compute-dtype parameter shard lives between uses: the store protocol, the device tier, and the
fence that says whether a background optimizer step has produced a group's new shard yet ([Note: update fence]).

One store per engine, chosen once from ``offload.params`` (zinf/placement.py) and built complete
by its constructor; groups only call ``fetch`` / ``done`` around their all-gather, ``writer`` /
``commit`` when their shard is rewritten (an optimizer step, an edit) and ``read`` when a frozen group's values
are read outside training (see [Note: frozen groups] in zinf/param/master.py). The host and NVMe stores live in
zinf/offload/param_store.py; the rest of the engine never asks which one it holds.
"""

from __future__ import annotations

import threading

from typing import Callable, Protocol

import torch

from zinf.native.checksum import ContentCheck
from zinf.param.keys import GroupKey
from zinf.report import StepTimers


__all__ = ["UpdateFence", "ShardStore", "DeviceShardStore"]


class ShardStore(Protocol):
    tier: str

    def prefetch(self, group: GroupKey, demand: bool = False) -> bool:
        """Start bringing ``group``'s shard closer (an NVMe read); False when there is no room for it now."""
        ...

    def fetch(self, group: GroupKey, defer_check: bool = False) -> torch.Tensor:
        """``group``'s shard on the compute device, the source of its all-gather. A store that copies it there (host
        or NVMe tiers, on CUDA) does so on the copy-in stream and makes the all-gather stream wait for that copy;
        the host buffer it copied from is reused only after the copy's fence (see zinf/runtime/streams.py).
        ``defer_check``: the caller copies the shard in one pass and can take its checksum there (``take_check``)."""
        ...

    def take_check(self, group: GroupKey) -> ContentCheck | None:
        """After ``fetch(group, defer_check=True)``: the checksum the caller's copy verifies before the values are
        used, or None where the store checked them itself ([Note: one pass per byte] in zinf/offload/in_place.py)."""
        ...

    def done(self, group: GroupKey) -> None:
        """The all-gather that read ``fetch``'s tensor has finished."""
        ...

    def read(self, group: GroupKey) -> torch.Tensor:
        """``group``'s shard as it is now, at its storage width, on the host or the device (outside training: a
        checkpoint, a state dict, an export). The caller copies what it keeps."""
        ...

    def writer(self, group: GroupKey) -> torch.Tensor:
        """A storage-dtype tensor of ``shard_numel`` elements to write ``group``'s new shard into."""
        ...

    def commit(self, group: GroupKey) -> None:
        """The new shard is written; store it."""
        ...

    def begin_update(self) -> None:
        """An optimizer step is about to write new shards (called on the training thread, before the step)."""
        ...

    def end_update(self) -> None:
        """The optimizer step has written every new shard (called on the thread that stepped)."""
        ...

    def keep_for_backward(self, keep: bool) -> None:
        """Whether shards gathered from now on are gathered again soon (a training forward's are, by its backward)."""
        ...

    def flush(self) -> None:
        """Finish every write in flight; afterwards the store's home alone holds the shards."""
        ...

    def close(self) -> None: ...

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of parameter shards this store keeps, per tier."""
        ...


class DeviceShardStore:
    """The device tier: the shard stays in the group, where compute runs."""

    tier = "device"

    def prefetch(self, group: GroupKey, demand: bool = False) -> bool:
        return True

    def fetch(self, group: GroupKey, defer_check: bool = False) -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def take_check(self, group: GroupKey) -> ContentCheck | None:
        return None

    def done(self, group: GroupKey) -> None:
        return None

    def read(self, group: GroupKey) -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def writer(self, group: GroupKey) -> torch.Tensor:
        assert group.shard is not None
        return group.shard

    def commit(self, group: GroupKey) -> None:
        return None

    def begin_update(self) -> None:
        return None

    def end_update(self) -> None:
        return None

    def keep_for_backward(self, keep: bool) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def bytes_by_tier(self) -> dict[str, int]:
        return {}  # the group's own shard, counted with the group


DEVICE_STORE = DeviceShardStore()


# -- whether a background step has produced a shard yet ---------------------------------------------------------
# [Note: update fence]
# Which groups' new shards a background optimizer step has not produced yet.
# 
# A background step (zinf/optim/offloaded.py [Note: background step]) updates the groups in order while the
# next forward starts; a gather of a group whose update is still running must wait for it, and a gather after a
# failed step must raise that step's error instead of training on a half-updated model. The fence is built
# once by the placement and handed to every group, the parameter store and the optimizer; with no background
# step nothing is ever pending and every call is a dictionary lookup.


class UpdateFence:
    """The groups still pending, under one condition variable: a step begins with one set, not an event per group
    (made on the training thread between the backward and the next forward, they cost it a millisecond a step)."""

    def __init__(self, timers: StepTimers | None = None) -> None:
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._error: BaseException | None = None
        self._timers = timers or StepTimers()
        # advances the step on the waiting thread ([Note: a sweep the gathers drive] in zinf/optim/driven_sweep.py)
        self._driver: Callable[["GroupKey | None"], None] | None = None

    def drive_by(self, driver: Callable[["GroupKey | None"], None] | None) -> None:
        """From now on a wait first calls ``driver(group)`` (``driver(None)`` for the whole step), which steps the
        updates itself on the waiting thread; None: the updates happen elsewhere (a worker thread, or none)."""
        self._driver = driver

    def begin(self, groups: "list[GroupKey]") -> None:
        """A background step starts: every group in ``groups`` is pending until ``finish``."""
        with self._cond:
            self._pending = {id(g) for g in groups}

    def finish(self, group: GroupKey) -> None:
        with self._cond:
            if id(group) in self._pending:
                self._pending.discard(id(group))
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The step failed: every group stays pending for good and its waiters raise ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def pending(self, group: GroupKey) -> bool:
        return self._error is not None or id(group) in self._pending

    def wait(self, group: GroupKey) -> None:
        """Block until ``group``'s update is done (timed as ``optimizer_wait``: the step fell behind the forward, or
        with a driver this thread stepped it); raise the step's error if it failed."""
        if id(group) in self._pending and self._error is None:
            with self._timers.time("optimizer_wait"):
                driver = self._driver
                if driver is not None:
                    driver(group)
                with self._cond:
                    self._cond.wait_for(lambda: id(group) not in self._pending or self._error is not None)
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        driver = self._driver
        if driver is not None and self._error is None:  # its end too (trailing writes, the next read-ahead)
            driver(None)
        with self._cond:
            self._cond.wait_for(lambda: not self._pending or self._error is not None)
