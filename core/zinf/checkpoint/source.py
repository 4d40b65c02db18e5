"""What checkpointing reads of a model in training: the protocol ``ModelSource``.

Saving, loading and exporting (``model_state.py``, ``sharded.py``, ``export.py``) take any object with these
members, not an engine class, so this package depends on the parts it reads (groups, comm, optimizer) and never on
the engine that holds them. The engine has them all and is passed as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from zinf.optim.protocol import ShardOptimizer
    from zinf.param.flat_group import FlatParamGroup
    from zinf.runtime.comm import Comm
    from zinf.update.loss_scale import DynamicLossScaler

__all__ = ["ModelSource", "SourceSettings"]


class SourceSettings(Protocol):
    """The settings a checkpoint reads: the precision it records, and whether buffers are rank 0's everywhere."""

    @property
    def precision(self) -> str: ...

    @property
    def broadcast_buffers(self) -> bool: ...


class ModelSource(Protocol):
    """A partitioned model with its training state, as checkpointing reads and restores it."""

    @property
    def module(self) -> nn.Module:
        """The model, whose names (less ``name_prefix``) are the names a checkpoint records."""
        ...

    @property
    def name_prefix(self) -> str:
        """What a front end's root module adds in front of every name of the user's module."""
        ...

    @property
    def groups(self) -> Sequence[FlatParamGroup]:
        """The flat parameter groups, in the order a checkpoint lays them out."""
        ...

    @property
    def comm(self) -> Comm:
        """The data-parallel ranks: this rank, the world size, the collectives a save and a load agree through."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the groups compute; a loaded master shard goes there before its group takes it."""
        ...

    @property
    def config(self) -> SourceSettings:
        """The settings a checkpoint reads (see ``SourceSettings``)."""
        ...

    @property
    def optimizer(self) -> ShardOptimizer | None:
        """The optimizer whose per-group state is saved and restored; ``None`` when there is none."""
        ...

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The fp16 loss scaler whose state is saved and restored; ``None`` under other precisions."""
        ...

    @property
    def global_step(self) -> int:
        """The optimizer steps taken: the step a save records (a load hands it back, it does not set it)."""
        ...

    def master_of(self, group: FlatParamGroup) -> torch.Tensor:
        """This rank's fp32 master shard of ``group``."""
        ...
