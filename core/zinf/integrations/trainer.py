"""transformers' ``Trainer`` (and TRL's trainers, its subclasses) saves, resumes and loads its best model when the
model it trains is a zinf engine (``zinf launch``), with the script unchanged.

[Note: Trainer checkpoints under zinf]
Trainer has branches of its own for DeepSpeed and FSDP only; every other model takes paths where the main process
alone reads or writes whole weights, which a partitioned model does not have. zinf wraps the five methods on those
paths that touch weights or optimizer state; each runs on every rank in Trainer (checked against transformers 5.x,
the ``test`` extra), so the wrappers may issue collectives, and each defers to the original unless the trainer's
model is a zinf engine (``trainer.model_wrapped.engine``) or, before ``prepare``, a launcher enabled zinf:

- ``_save`` (``save_model``, its checkpoints and ``push_to_hub``'s local save): Trainer's own ``_save`` writes
  ``config.json``, the generation config, the tokenizer and ``training_args.bin``; the weights are streamed by
  ``zinf.checkpoint.save_safetensors`` (every rank gathers one group at a time, rank 0 writes each shard when it is
  complete: memory one group plus one shard, never the whole model), in the dtype the model's parameters were built
  in (as DDP saves them: fp32 under bf16 mixed precision, where the engine computes in bf16), tied weights once,
  as ``model.safetensors`` or shards + index. For a peft model only what peft saves is gathered (the adapter, not
  the frozen base) and handed to Trainer's ``_save``: ``adapter_config.json`` + ``adapter_model.safetensors``.
- ``_save_optimizer_and_scheduler``: ``engine.save_checkpoint(checkpoint-N/zinf)`` on every rank (fp32 masters,
  optimizer state with its hyper-parameters, loss scaler, step; one part per rank), and the LR scheduler's
  ``scheduler.pt`` from the saving rank. No ``optimizer.pt``: the optimizer state is in the shards.
- ``_load_from_checkpoint`` runs before ``prepare``, when the model may already be partitioned (a ``from_pretrained``
  under ``zinf launch``): it loads nothing when the checkpoint holds zinf shards; the engine restores the weights
  from them after ``prepare``. A checkpoint without them (written without zinf) is refused with the fix.
- ``_load_optimizer_and_scheduler`` runs after ``prepare`` (where Trainer's DeepSpeed branch loads its engine's
  checkpoint): ``engine.load_checkpoint(checkpoint-N/zinf)`` restores weights and optimizer state on every rank,
  then the LR scheduler from ``scheduler.pt``.
- ``_load_best_model``: ``engine.load_checkpoint`` of the best checkpoint's shards (weights, and as with
  DeepSpeed the optimizer state of that step). A checkpoint without shards (``save_only_model=True``) holds the
  weights alone, which are loaded as Trainer loads them (the optimizer state stays the last step's): the model's
  files streamed into each rank's slices, or a peft adapter's file into the adapter's fp32 masters.

RNG files, ``trainer_state.json``, the data skip on resume and checkpoint rotation are Trainer's, unchanged.

The methods are wrapped when zinf's integrations are activated, not when zinf is imported: by ``zinf launch`` before
the script runs (so before ``_load_from_checkpoint``), and by building an engine, which comes before every other
wrapped step ([Note: integrations are activated, not imported] in zinf/integrations/__init__.py).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

from zinf.checkpoint.export import save_safetensors
from zinf.checkpoint.pretrained import load_pretrained
from zinf.checkpoint.tensor_files import open_weights
from zinf.engine import ZeroInfinityEngine
from zinf.errors import CheckpointError
from zinf import integrations
from zinf.integrations import transformers as hf_models
from zinf.integrations.after_import import when_imported, wrap_once
from zinf.param.gathered import GatheredParameters
from zinf.tiling import tile_spec

__all__ = ["install", "watch", "engine_of", "SHARDS_DIR"]

log = logging.getLogger(__name__)

SHARDS_DIR = "zinf"  # zinf's shards inside a checkpoint-N directory
_MODULE = "transformers.trainer"
_WRAPPED = ("_save", "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
            "_load_best_model")
_originals: dict[str, Any] = {}


def watch() -> None:
    """Wrap ``Trainer``'s methods now if ``transformers.trainer`` is loaded, else as soon as it is (called by
    ``zinf.integrations.activate``)."""
    when_imported(_MODULE, install)


integrations.register(watch)


def install() -> bool:
    """Wrap ``Trainer``'s save and load steps once; False when transformers is not installed or has none of them."""
    return wrap_once(_originals, _MODULE, _wrap)


def _wrap(module: Any) -> bool:
    cls = module.Trainer
    missing = [n for n in _WRAPPED if n not in cls.__dict__]
    if missing:
        log.warning("zinf: transformers %s has no Trainer.%s; Trainer checkpoints of a zinf model are not supported "
                    "with it (use a transformers release of zinf's 'test' extra, or save_strategy='no').",
                    getattr(sys.modules.get("transformers"), "__version__", "?"), missing[0])
        return False
    _originals.update({n: cls.__dict__[n] for n in _WRAPPED})
    cls._save = _save
    cls._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
    cls._load_from_checkpoint = _load_from_checkpoint
    cls._load_optimizer_and_scheduler = _load_optimizer_and_scheduler
    cls._load_best_model = _load_best_model
    return True


def engine_of(trainer: Any) -> ZeroInfinityEngine | None:
    """The zinf engine that trains ``trainer``'s model (its prepared model's ``.engine``), or None."""
    engine = getattr(trainer.model_wrapped, "engine", None)
    return engine if isinstance(engine, ZeroInfinityEngine) else None


def _shards(checkpoint: str) -> str:
    return os.path.join(checkpoint, SHARDS_DIR)


# -- saving ------------------------------------------------------------------------------------------------------
def _save(self: Any, output_dir: str | None = None, state_dict: dict | None = None) -> None:
    engine = engine_of(self)
    if engine is None or state_dict is not None:
        return _originals["_save"](self, output_dir, state_dict=state_dict)
    if _is_peft(self.model):
        return _originals["_save"](self, output_dir, state_dict=_adapter_state_dict(self))
    # Trainer's own _save writes the config, generation config, tokenizer and training arguments (with an empty
    # weights file, as its DeepSpeed branch does), then the weights are streamed in their place
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    _originals["_save"](self, output_dir, state_dict={})
    save_safetensors(engine, output_dir, dtype=_weights_dtype(engine))
    return None


def _weights_dtype(engine: ZeroInfinityEngine) -> torch.dtype:
    """The dtype ``save_pretrained`` writes the weights in without zinf: the one the model's floating parameters were
    built in (fp32 when they differ), which each group's slots keep. Not the parameters' dtype now: under mixed
    precision their placeholders are in the compute dtype (bf16), while DDP keeps and saves the parameters as built
    (fp32; the fp32 masters are then written as they are, as ``get_state_dict`` and ``consolidate`` give them)."""
    dtypes = {s.dtype for g in engine.groups for s in g.slots if s.dtype.is_floating_point}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _adapter_state_dict(trainer: Any) -> dict[str, torch.Tensor]:
    """What a peft model's ``save_pretrained`` saves (its adapters, under the model's own names), gathered for the
    saving rank(s), ``{}`` on the others; only the groups holding those parameters are gathered. Every rank must call
    it (the choice depends on the model alone, so all ranks gather the same groups)."""
    from peft.utils import get_peft_model_state_dict

    model = trainer.model
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    chosen = {id(v) for adapter in model.peft_config
              for v in get_peft_model_state_dict(model, state_dict=named, adapter_name=adapter).values()}
    names = [n for n, v in named.items() if id(v) in chosen]
    with GatheredParameters([named[n] for n in names if isinstance(named[n], nn.Parameter)]):
        if not trainer.args.should_save:
            return {}
        return {n: named[n].detach().clone().cpu() for n in names}


def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
    engine = engine_of(self)
    if engine is None:
        return _originals["_save_optimizer_and_scheduler"](self, output_dir)
    engine.save_checkpoint(_shards(output_dir))
    if self.args.should_save:
        from transformers.trainer import SCHEDULER_NAME
        from transformers.trainer_pt_utils import reissue_pt_warnings

        with warnings.catch_warnings(record=True) as caught:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        reissue_pt_warnings(caught)
    return None


# -- loading -----------------------------------------------------------------------------------------------------
def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    if engine_of(self) is None and not hf_models.enabled():
        return _originals["_load_from_checkpoint"](self, resume_from_checkpoint, model)
    if not os.path.isfile(os.path.join(_shards(resume_from_checkpoint), "commit.json")):
        raise CheckpointError(
            f"zinf: {resume_from_checkpoint} holds no zinf shards ({SHARDS_DIR}/commit.json), so it was not written by a "
            "Trainer on zinf and its optimizer state cannot be restored into the engine. Resume from a checkpoint "
            "written under zinf launch, or start a new run from its weights: from_pretrained(<that directory>) "
            "without resume_from_checkpoint.")
    log.info("zinf: resuming from %s: the weights come from its zinf shards once the engine is built",
             resume_from_checkpoint)
    return None


def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
    engine = engine_of(self)
    if engine is None or checkpoint is None:
        return _originals["_load_optimizer_and_scheduler"](self, checkpoint)
    engine.load_checkpoint(_shards(checkpoint))
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import reissue_pt_warnings

    scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
    if os.path.isfile(scheduler):
        with warnings.catch_warnings(record=True) as caught:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        reissue_pt_warnings(caught)
    return None


def _load_best_model(self: Any) -> None:
    engine = engine_of(self)
    if engine is None:
        return _originals["_load_best_model"](self)
    best = self.state.best_model_checkpoint
    log.info("zinf: loading the best model from %s (score: %s)", best, self.state.best_metric)
    if os.path.isfile(os.path.join(_shards(best), "commit.json")):
        engine.load_checkpoint(_shards(best))
    elif _is_peft(self.model):
        _load_best_adapter(self, engine, best)
    else:
        _load_best_weights(self, engine, best)
    return None


def _load_best_weights(trainer: Any, engine: ZeroInfinityEngine, best: str) -> None:
    """A best checkpoint without zinf shards (``save_only_model=True``) holds the model's weights alone: loaded as
    Trainer loads them without zinf (``load_state_dict(strict=False)`` and its warnings about the keys; the optimizer
    state stays the last step's), each rank reading only its slices of the files (``zinf.load_pretrained``). A tiled
    layer is saved untiled, so with tiled layers the files are read whole and split (``load_full_state_dict``)."""
    from transformers.trainer import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    if not any(os.path.isfile(os.path.join(best, n)) for n in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
                                                                WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        log.warning("zinf: no model weights in the best checkpoint %s; the model keeps its last weights", best)
        return
    engine.synchronize()  # a background optimizer step may still be writing the masters
    if tile_spec(engine.module):
        with open_weights(best) as files:
            state = {k: files.read_range(k, 0, t.numel).view(t.shape).clone() for k, t in files.tensors.items()}
        engine.load_full_state_dict(state, strict=False)
        return
    engine.hooks.keep.drop()  # groups a forward kept gathered would keep the last values
    report = load_pretrained(engine.module, best, strict=False)
    trainer._issue_warnings_after_load(report.incompatible_keys())


def _load_best_adapter(trainer: Any, engine: ZeroInfinityEngine, best: str) -> None:
    """The best checkpoint of a peft model without zinf shards holds the active adapter's file alone (what ``_save``
    wrote): each of its tensors goes into the parameter that ``get_peft_model_state_dict`` saved under its key, through
    the fp32 master of that parameter's group (only the adapter's groups change; the frozen base is not touched)."""
    from peft.utils import get_peft_model_state_dict
    from transformers.trainer import ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME

    files = [os.path.join(best, n) for n in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
             if os.path.isfile(os.path.join(best, n))]
    if not files:
        log.warning("zinf: no adapter weights in the best checkpoint %s; the model keeps its last weights", best)
        return
    model = trainer.model
    named = dict(model.named_parameters(remove_duplicate=False))
    saved = get_peft_model_state_dict(model, state_dict=named, adapter_name=model.active_adapters[0])
    with open_weights(files[0]) as tensors:
        values = {id(p): tensors.read_range(k, 0, p.numel()).clone() for k, p in saved.items()
                  if isinstance(p, nn.Parameter) and k in tensors.tensors}
    engine.synchronize()
    for g in engine.groups:
        mine = [(slot, values[id(p)]) for p, slot in zip(g.params, g.slots) if p is not None and id(p) in values]
        if not mine:
            continue
        master = g.master_shard.read().to("cpu", torch.float32, copy=True)
        lo, hi = g.layout.lo, g.layout.lo + g.shard_numel
        for slot, value in mine:  # the part of each parameter in this rank's shard
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                master[start - lo : end - lo] = value[start - slot.offset : end - slot.offset].float()
        engine.set_master(g, master.to(g.device))


def _is_peft(model: nn.Module) -> bool:
    if "peft" not in sys.modules:
        return False
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))
