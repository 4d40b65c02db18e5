"""The Lightning precision plugin: backward, the optimizer step and gradient clipping go to the engine.

The engine owns dtypes (parameters are gathered in the compute dtype, masters are fp32), so module
and tensor init contexts, module conversion and autocast are all no-ops here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import zinf

__all__ = ["ZeroInfinityPrecision"]


class ZeroInfinityPrecision(Precision):
    """``precision`` is the Lightning flag ("32-true", "bf16-mixed", "16-mixed", "bf16-true", ...)."""

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.engine: "zinf.ZeroInfinityEngine | None" = None  # set by the strategy at setup

    def _engine(self) -> "zinf.ZeroInfinityEngine":
        if self.engine is None:
            raise RuntimeError("zero_infinity: the engine is not built yet (the strategy builds it in setup()).")
        return self.engine

    @override
    def backward(self, tensor: Tensor, model: "pl.LightningModule", optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._engine().backward(tensor, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then Lightning's gradient clipping
        if model.automatic_optimization and closure_result is None:
            raise MisconfigurationException(
                "zero_infinity: training_step returned None, which would skip backward on this rank only; the "
                "engine's collectives need every rank. Return a loss on every rank (multiply it by 0 to skip)."
            )
        self._engine().step()
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._engine().clip_grad_norm_(float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        raise MisconfigurationException(
            "zero_infinity: gradient_clip_algorithm='value' is not supported (each rank holds 1/world of every "
            "gradient). Use gradient_clip_algorithm='norm' (the default)."
        )

