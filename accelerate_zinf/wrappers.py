"""What ``Accelerator.prepare`` hands back for a model and its optimizer on zinf.

``ZinfModel`` holds the user's module as ``.module`` (as DDP does), so ``model.train()``,
``model.parameters()`` and ``unwrap_model`` behave as usual; calling it runs the engine's forward
(inputs cast to the compute dtype, parameters gathered by the engine's hooks) and, under mixed
precision, returns floating outputs in fp32 as Accelerate's own model wrapper does. transformers models
inside it generate in lockstep on all ranks (see [Note: generate in lockstep] in accelerate_zinf/generation.py).

``ZinfOptimizer`` is an ``AcceleratedOptimizer`` around the user's optimizer (so LR schedulers,
``param_groups`` and Accelerate's gradient-accumulation gating keep working); its ``step`` is the
engine's step and its ``zero_grad`` the engine's, skipped when the step already emptied the
gradient shards (an offloaded step's background update is not waited for).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn

import zinf
from accelerate_zinf.generation import LockstepGenerate
from zinf.utils import map_tensors

__all__ = ["ZinfModel", "ZinfOptimizer", "PendingModel", "refuse_partitioned_state_dict"]


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32:
        return x.float()
    return x


def refuse_partitioned_state_dict(engine: zinf.ZeroInfinityEngine) -> None:
    """Make ``module.state_dict()`` of a partitioned model an error instead of a dict of empty placeholders.

    Code written for DDP saves ``model.state_dict()`` on the main process only: under zinf that would write files
    without weights, silently. Inside ``engine.gathered_parameters()`` every parameter is whole and ``state_dict()``
    works. (transformers' Trainer saves this way too; zinf/integrations/trainer.py gathers for it on every rank.)
    """

    def check(module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        if not engine.all_gathered():
            raise RuntimeError(
                "zinf: state_dict() of a model partitioned by zinf has no weights (each rank holds a slice). Call "
                "accelerator.get_state_dict(model) or accelerator.save_model(model, dir) on every rank instead (with "
                "transformers' Trainer: trainer.save_model(dir) on every rank), or read the weights inside "
                "`with model.engine.gathered_parameters():`.")

    engine.module.register_state_dict_post_hook(check)


class ZinfModel(nn.Module):
    """The prepared model: ``.module`` is the user's module, ``.engine`` the zinf engine that owns it."""

    def __init__(self, engine: zinf.ZeroInfinityEngine) -> None:
        super().__init__()
        self.module = engine.module
        self._zinf_engine = engine
        self._lockstep = LockstepGenerate(engine.module, engine.comm.world)

    @property
    def engine(self) -> zinf.ZeroInfinityEngine:
        return self._zinf_engine

    def close(self) -> None:
        """Finish the engine's background work and close it (hooks removed, offload files released); the
        transformers models inside get their class's ``generate`` back."""
        self._zinf_engine.synchronize()
        self._zinf_engine.close()
        self._lockstep.remove()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._zinf_engine(*args, **kwargs)
        if self._zinf_engine.config.compute_dtype != torch.float32:
            out = map_tensors(_to_fp32, out)
        return out


class PendingModel(nn.Module):
    """A model prepared without its optimizer: the engine is built when ``prepare`` sees an optimizer over
    its parameters, or at the first call (then without an optimizer, for inference)."""

    def __init__(self, module: nn.Module, build: Callable[["PendingModel", torch.optim.Optimizer | None], ZinfModel]) -> None:
        super().__init__()
        self.module = module
        self._build = build
        self.built: ZinfModel | None = None

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for pg in optimizer.param_groups for p in pg["params"])

    def resolve(self, optimizer: torch.optim.Optimizer | None) -> ZinfModel:
        if self.built is None:
            self.built = self._build(self, optimizer)
        return self.built

    @property
    def engine(self) -> zinf.ZeroInfinityEngine:
        return self.resolve(None).engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve(None)(*args, **kwargs)


class ZinfOptimizer(AcceleratedOptimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, engine: zinf.ZeroInfinityEngine) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.gradient_state.sync_gradients:
            self._is_overflow = not self.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:  # free where the shards are empty (after step(), or no backward)
            self.engine.zero_grad()

    def state_dict(self) -> dict:
        """This rank's optimizer state (of its shards); ``Accelerator.save_state`` saves every rank's."""
        assert self.engine.optimizer is not None
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        assert self.engine.optimizer is not None
        self.engine.optimizer.load_state_dict(state_dict)
