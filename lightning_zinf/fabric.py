"""``Fabric(strategy="zero_infinity")``: Fabric's DDP launching and collectives, zinf's training.

``fabric.init_module()`` builds the model under ``zinf.Init``; ``fabric.setup(model, optimizer)``
builds the engine; ``fabric.backward``, ``optimizer.step()`` and ``fabric.clip_gradients`` go to it;
``fabric.save`` / ``fabric.load`` write and read a directory of per-rank shards.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

import zinf
from lightning_zinf._shared import (
    build_engine, lightning_precision_name, module_names, offload_preset, resolve_config, with_precision,
)

__all__ = ["ZeroInfinityFabricStrategy", "ZeroInfinityFabricPrecision"]

log = logging.getLogger(__name__)


class ZeroInfinityFabricPrecision(Precision):
    """The engine owns dtypes: no module conversion, no autocast; outputs come back in fp32."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision  # type: ignore[assignment]

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, Tensor, lambda t: t.float() if t.is_floating_point() else t)


class _EngineForward(nn.Module):
    """What ``_FabricModule`` calls: the user's ``forward`` run by ``engine.forward`` (see _shared.StepRoot)."""

    def __init__(self, engine: zinf.ZeroInfinityEngine) -> None:
        super().__init__()
        self.root = engine.module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine("forward", *args, **kwargs)


class _NoSync(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()  # gradients accumulate in the engine's shards; nothing to skip


class ZeroInfinityFabricStrategy(DDPStrategy, _Sharded):
    """ZeRO-Infinity for ``lightning.fabric``; arguments as :class:`lightning_zinf.ZeroInfinityStrategy`."""

    def __init__(
        self,
        config: zinf.ZeroConfig | Mapping[str, Any] | None = None,
        *,
        start_method: str = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.zero_config = resolve_config(config)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,  # type: ignore[arg-type]
        )
        self._backward_sync_control = _NoSync()
        self.engine: zinf.ZeroInfinityEngine | None = None

    @property
    @override
    def precision(self) -> ZeroInfinityFabricPrecision:
        if self._precision is None:
            self._precision = ZeroInfinityFabricPrecision(lightning_precision_name(self.zero_config))
        return self._precision  # type: ignore[return-value]

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        if precision is None:
            self._precision = None
            return
        self.zero_config = with_precision(self.zero_config, str(precision.precision))
        if not isinstance(precision, ZeroInfinityFabricPrecision):
            precision = ZeroInfinityFabricPrecision(str(precision.precision))
        self._precision = precision

    # -- model construction and setup -------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: every module is partitioned as soon as it is built (empty_init is ignored)."""
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(zinf.Init(self.zero_config, device=self.root_device))
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return zinf.Init(self.zero_config, device=self.root_device)

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        self.engine = build_engine(module, list(optimizers), self.zero_config, self.root_device)
        return _EngineForward(self.engine), list(optimizers), scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self.engine = build_engine(module, [], self.zero_config, self.root_device)
        return _EngineForward(self.engine)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise RuntimeError(
            "zero_infinity: the engine needs the model and its optimizer together. Call "
            "`model, optimizer = fabric.setup(model, optimizer)` instead of setup_module + setup_optimizers."
        )

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """The engine places the shards; the full model is never moved."""

    # -- training ---------------------------------------------------------------------------------
    def _engine(self) -> zinf.ZeroInfinityEngine:
        if self.engine is None:
            raise RuntimeError("zero_infinity: call `fabric.setup(model, optimizer)` first.")
        return self.engine

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(tensor, module)
        self._engine().backward(tensor, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> bool:
        return self._engine().step()

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        if float(norm_type) != 2.0:
            raise ValueError(f"zero_infinity: clip_gradients(norm_type={norm_type}) is not supported; use norm_type=2.")
        return self._engine().clip_grad_norm_(float(max_norm))

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise NotImplementedError(
            "zero_infinity: clipping by value is not supported (each rank holds 1/world of every gradient). "
            "Use fabric.clip_gradients(model, optimizer, max_norm=...)."
        )

    def _load_raw(self, path: _PATH, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """``fabric.load_raw(path, model)``: an ordinary state dict (``torch.save(model.state_dict())``) loaded into
        the shards, every rank taking its own; only tensors are read unless ``weights_only=False``."""
        if not isinstance(state, nn.Module):
            raise TypeError(f"zero_infinity: {path} is one file, which loads into a model only "
                            "(fabric.load_raw(path, model)); an optimizer's state is in the directory "
                            "fabric.save wrote: fabric.load(directory, state).")
        module = getattr(state, "_forward_module", state)
        module = module.root if isinstance(module, _EngineForward) else module
        loaded = torch.load(path, map_location="cpu", weights_only=weights_only is not False)
        self._engine().load_full_state_dict(module_names(loaded, module), strict=strict)
        return {}

    # -- checkpoints: a directory of per-rank shards; other state in the engine's client state ------
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        if storage_options is not None or filter:
            raise TypeError("zero_infinity: fabric.save(storage_options=..., filter=...) is not supported; each rank "
                            "writes its own shard file into the checkpoint directory.")
        client_state = {k: _state_of(v) for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))}
        self._engine().save_checkpoint(str(path), client_state=client_state)

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if os.path.isfile(path):  # fabric.load_raw: one file of a module's ordinary state dict
            return self._load_raw(path, state, strict, weights_only)
        # Fabric's weights_only=False is the user saying the file is trusted (else the config's checkpoint.allow_pickle)
        client_state = self._engine().load_checkpoint(str(path), allow_pickle=True if weights_only is False else None)
        if not isinstance(state, dict):  # a module, an optimizer or nothing: the engine restored what there is
            return client_state if not state else {}
        for name, obj in state.items():
            if isinstance(obj, (nn.Module, Optimizer)) or name not in client_state:
                if strict and not isinstance(obj, (nn.Module, Optimizer)):
                    raise KeyError(f"zero_infinity: '{name}' is not in the checkpoint at {path} "
                                   f"(it holds {sorted(client_state)}). Pass strict=False to skip it.")
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(client_state.pop(name))
            else:
                state[name] = client_state.pop(name)
        return client_state

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().teardown()


class ZeroInfinityFabricOffloadStrategy(ZeroInfinityFabricStrategy):
    """The offload presets: "zero_infinity_offload" (CPU) and "zero_infinity_nvme" (ZINF_NVME_PATHS)."""

    def __init__(self, config: Any = None, *args: Any, preset: str = "zero_infinity_offload", **kwargs: Any) -> None:
        super().__init__(offload_preset(preset, config), *args, **kwargs)


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if isinstance(obj, _Stateful) else obj
