"""transformers' ``generate`` on a zinf model runs in lockstep on every rank.

[Note: generate in lockstep]
Every forward of a partitioned model gathers its parameters from all ranks, so all ranks must run the same
number of forwards. ``generate`` stops when this rank's sequences are finished; when the ranks complete
different prompts (each rank its share: evaluation, TRL's online trainers) one rank stops earlier and the
others wait in their next gather for a rank that has moved on (a hang until the collective timeout, or a
collective paired with the wrong one). transformers knows this problem from DeepSpeed ZeRO-3 and FSDP: with
``synced_gpus=True`` a finished rank keeps running forwards (whose outputs it ignores) until every rank is
done, and it turns that on by itself for the models it recognises as sharded. A zinf model it does not
recognise, so each transformers model (``GenerationMixin``) inside a prepared model gets ``generate`` with
``synced_gpus=True`` by default when several ranks share the model; an explicit ``synced_gpus`` is kept.
A ``PeftModel``'s ``generate`` calls its base model's, which is covered. Calling ``generate`` on one rank
only (``if accelerator.is_main_process:``) cannot work on a partitioned model (the other ranks hold parts
of every weight): call it on every rank.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from torch import nn

__all__ = ["LockstepGenerate"]


class LockstepGenerate:
    """Gives every ``GenerationMixin`` module of ``model`` a ``generate`` whose ``synced_gpus`` defaults to True
    (see [Note: generate in lockstep]); ``remove()`` restores the class's own ``generate``."""

    def __init__(self, model: nn.Module, world: int) -> None:
        self._modules: list[nn.Module] = []
        if world <= 1:
            return
        transformers = sys.modules.get("transformers")
        if transformers is None:  # a transformers model imported it already: without it, nothing generates
            return
        for module in model.modules():
            if isinstance(module, transformers.GenerationMixin) and "generate" not in module.__dict__:
                module.generate = _in_lockstep(module.generate)  # type: ignore[method-assign]
                self._modules.append(module)

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("generate", None)
        self._modules.clear()


_SYNCED_GPUS_POSITION = 5  # generate(inputs, generation_config, logits_processor, stopping_criteria,
#                                  prefix_allowed_tokens_fn, synced_gpus, ...)


def _in_lockstep(generate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= _SYNCED_GPUS_POSITION and kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    return wrapper
