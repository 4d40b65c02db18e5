"""Turn a zinf sharded checkpoint directory into an ordinary single-file Lightning checkpoint.

Offline (no process group): the per-rank fp32 master shards are consolidated into a full
``state_dict`` with ``zinf.checkpoint.consolidate``, and Lightning's own state (epoch, global step,
loops, callbacks, LR schedulers, hyper-parameters) is taken from the client state the strategy
stored. The optimizer state stays sharded and is not converted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from zinf.checkpoint import consolidate, read_client_state

__all__ = ["convert_to_lightning_checkpoint", "consolidate_state_dict"]

log = logging.getLogger(__name__)


def consolidate_state_dict(checkpoint_dir: str | os.PathLike, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 ``state_dict`` of the LightningModule (or Fabric module) saved in ``checkpoint_dir``, under
    its own names: a checkpoint records the user's module's names, the step root's prefix already removed (see
    [Note: the step root] in lightning_zinf/_shared.py), so nothing is stripped here. To write it to disk with
    bounded memory (safetensors, the Hugging Face layout) use ``zinf consolidate``."""
    return consolidate(checkpoint_dir, allow_pickle=allow_pickle)


def convert_to_lightning_checkpoint(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike | None = None,
                                    allow_pickle: bool = False) -> dict[str, Any]:
    """Build ``{**lightning_state, "state_dict": full_weights}`` and, when ``output_file`` is given, save it.

    The result loads with ``LightningModule.load_from_checkpoint(output_file)``, with
    ``Trainer(strategy="ddp").fit(ckpt_path=output_file)`` (weights and Lightning state; the optimizer
    starts fresh) and with ``Trainer(strategy="zero_infinity")`` (weights written into the shards).
    ``allow_pickle``: the checkpoint is trusted (Lightning's state may hold any object; see docs/checkpoints.md).
    """
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint = dict(read_client_state(checkpoint_dir, allow_pickle))
    checkpoint["state_dict"] = consolidate_state_dict(checkpoint_dir, allow_pickle)
    checkpoint.setdefault("optimizer_states", [])
    if output_file is not None:
        torch.save(checkpoint, output_file)
        log.info("zero_infinity: wrote %s (%d tensors) from %s", output_file, len(checkpoint["state_dict"]),
                 checkpoint_dir)
    return checkpoint
