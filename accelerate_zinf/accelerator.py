"""``accelerate_zinf.Accelerator``: Accelerate's ``Accelerator`` with models and optimizers trained by zinf.

Everything Accelerate does for data loaders, LR schedulers, gathering, trackers, RNG and sampler state
is unchanged. What changes is what a model and its optimizer become in ``prepare`` (a zinf engine,
wrapped as :class:`~accelerate_zinf.wrappers.ZinfModel` / :class:`~accelerate_zinf.wrappers.ZinfOptimizer`)
and the methods that touch parameters, gradients or their state:

- ``backward`` divides by ``gradient_accumulation_steps`` as Accelerate does, then runs the engine's
  backward (gradients are reduce-scattered into fp32 shards; with fp16 the engine's loss scaler applies).
- ``accumulate`` / ``no_sync``: every micro-batch's gradient is reduce-scattered into the shards, so
  skipping a synchronisation saves nothing and changes nothing; ``optimizer.step()`` only steps when
  ``sync_gradients`` is true, as in Accelerate.
- ``clip_grad_norm_`` clips the global norm over all ranks' shards (norm 2 only).
- ``get_state_dict`` / ``save_model`` gather one parameter group at a time (``save_model`` streams into
  safetensors shards, never holding the whole model); ``save_state`` / ``load_state`` write and read each
  rank's shard files (under ``zinf_model``) next to Accelerate's own files.
- ``init_module()`` builds a model under ``zinf.Init`` (no rank ever holds all of it).
- with trackers (``log_with=...`` and ``init_trackers``), every ``zinf_report_every``-th optimizer step's
  report (:meth:`zinf.StepReport.metrics`: ``zinf/compute``, ``zinf/all_gather``, ``zinf/bytes_cpu``,
  ``zinf/io_hidden_share``, ...) goes to them through ``accelerator.log``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import Any, Callable, Iterable, Iterator, Mapping

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend
from torch import nn

import zinf
from accelerate_zinf.settings import check_distributed_type, engine_config, with_mixed_precision
from accelerate_zinf.wrappers import PendingModel, ZinfModel, ZinfOptimizer, refuse_partitioned_state_dict
from zinf.errors import ConfigError, UnsupportedModelError

__all__ = ["Accelerator"]

log = logging.getLogger(__name__)

_ENGINE_DIR = "zinf_model"


class Accelerator(accelerate.Accelerator):
    """``Accelerator(..., zinf_config=None, zinf_report_every=10)``: every argument of Accelerate's, plus the
    engine config (a :class:`zinf.ZeroConfig`, a mapping or a YAML path; see
    :func:`accelerate_zinf.settings.engine_config`) and how often (in optimizer steps) the engine's step report
    is logged to the trackers (``accelerator.log(report.metrics(), step=<optimizer steps taken>)``; 0: never;
    nothing is logged before ``init_trackers``)."""

    def __init__(self, *args: Any, zinf_config: zinf.ZeroConfig | Mapping[str, Any] | str | None = None,
                 zinf_report_every: int = 10, **kwargs: Any) -> None:
        if not isinstance(zinf_report_every, int) or zinf_report_every < 0:
            raise ValueError(f"zinf: zinf_report_every={zinf_report_every!r} must be an int >= 0 (optimizer steps "
                             "between reports to the trackers; 0 turns them off).")
        self.zinf_report_every = zinf_report_every
        super().__init__(*args, **kwargs)
        check_distributed_type(self.distributed_type.value if hasattr(self.distributed_type, "value")
                               else self.distributed_type)
        if self.parallelism_config is not None and (self.parallelism_config.tp_enabled
                                                    or self.parallelism_config.cp_enabled):
            raise ConfigError("zinf: tensor/context parallelism (parallelism_config) cannot be combined with zinf; "
                              "drop it, zinf partitions over all data-parallel ranks.")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.num_processes != launched:
            raise ConfigError(
                f"zinf: {launched} processes were launched but Accelerate sees {self.num_processes}, so each would "
                "train alone. On CPU export ACCELERATE_USE_CPU=true (zinf launch does it for you) with "
                "distributed_type: MULTI_GPU and use_cpu: true.")
        self.zinf_config = with_mixed_precision(engine_config(zinf_config), self.mixed_precision)
        self._zinf_models: list[ZinfModel | PendingModel] = []

    # -- construction ------------------------------------------------------------------------------
    def init_module(self) -> zinf.Init:
        """``with accelerator.init_module(): model = Model(...)`` -- each module is partitioned as soon as it is
        built, so no rank ever holds the whole model (see :class:`zinf.Init`)."""
        return zinf.Init(self.zinf_config, device=self.device)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements (the number of objects passed).")
        placement = device_placement or [None] * len(args)
        result: list[Any] = list(args)
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module) and not _is_zinf(a)]
        optimizers = [i for i, a in enumerate(args)
                      if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
        claimed: set[int] = set()
        for i in models:
            mine = {id(p) for p in args[i].parameters()}
            own = [j for j in optimizers if j not in claimed
                   and any(id(p) in mine for pg in args[j].param_groups for p in pg["params"])]
            if len(own) > 1:
                raise UnsupportedModelError(
                    f"zinf: {len(own)} optimizers hold parameters of one model; the engine steps exactly one. Use one "
                    "optimizer with parameter groups for different hyper-parameters.")
            claimed.update(own)
            if own:
                model, opt = self._build(args[i], args[own[0]])
                result[i], result[own[0]] = model, opt
            else:
                result[i] = PendingModel(args[i], self._build_pending)
                self._zinf_models.append(result[i])
                self._models.append(result[i])
        for j in optimizers:
            if j not in claimed:
                result[j] = self._optimizer_for_pending(args[j])
        rest = [i for i, a in enumerate(args) if i not in models and i not in optimizers]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest), device_placement=[placement[i] for i in rest])
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                result[i] = obj
        for obj in result:
            if _is_zinf(obj) or isinstance(obj, ZinfOptimizer):
                obj._is_accelerate_prepared = True
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False) -> nn.Module:
        return model if _is_zinf(model) else self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        return optimizer if isinstance(optimizer, AcceleratedOptimizer) else self.prepare(optimizer)

    def _build(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[ZinfModel, ZinfOptimizer | None]:
        engine = zinf.ZeroInfinityEngine(module, optimizer, self.zinf_config, device=self.device)
        refuse_partitioned_state_dict(engine)
        self._compile_as_configured(engine)
        model = ZinfModel(engine)
        self._zinf_models.append(model)
        self._models.append(model)
        wrapped = None
        if optimizer is not None:
            wrapped = _ReportingOptimizer(optimizer, engine, self._report_step)
            self._optimizers.append(wrapped)
        return model, wrapped

    def _build_pending(self, pending: PendingModel, optimizer: torch.optim.Optimizer | None) -> ZinfModel:
        config = self.zinf_config if optimizer is not None else _without_optimizer_offload(self.zinf_config)
        engine = zinf.ZeroInfinityEngine(pending.module, optimizer, config, device=self.device)
        refuse_partitioned_state_dict(engine)
        self._compile_as_configured(engine)
        log.info("zinf: engine built for a model prepared on its own (%s)", "with its optimizer" if optimizer
                 else "no optimizer: inference only")
        return ZinfModel(engine)

    def _compile_as_configured(self, engine: zinf.ZeroInfinityEngine) -> None:
        """Accelerate's dynamo plugin (a launch config's ``dynamo_config``, ``TrainingArguments(torch_compile=True)``,
        ``Accelerator(dynamo_plugin=...)``): the model is compiled as ``prepare`` would compile it, in place (its
        repeated blocks alone with ``use_regional_compilation``), zinf's hooks outside the graphs."""
        plugin = self.state.dynamo_plugin
        if plugin.backend == DynamoBackend.NO:
            return
        engine.compile(regional=bool(plugin.use_regional_compilation), **plugin.to_kwargs())
        log.info("zinf: torch.compile(%s) of the model prepared (%s)", plugin.to_kwargs(),
                 "its repeated blocks" if plugin.use_regional_compilation else "whole")

    def _optimizer_for_pending(self, optimizer: torch.optim.Optimizer) -> ZinfOptimizer:
        for m in self._zinf_models:
            if isinstance(m, PendingModel) and m.owns(optimizer):
                if m.built is not None and m.built.engine.optimizer is not None:
                    break
                if m.built is not None:
                    _close_inference_engine(m)
                engine = m.resolve(optimizer).engine
                wrapped = _ReportingOptimizer(optimizer, engine, self._report_step)
                self._optimizers.append(wrapped)
                return wrapped
        raise UnsupportedModelError(
            "zinf: this optimizer holds no parameter of a model prepared by this Accelerator that is still waiting for "
            "its optimizer. Pass the model and its optimizer to one call: model, optimizer = accelerator.prepare(model, "
            "optimizer) (the engine partitions the optimizer's parameters when it is built).")

    # -- the training step ---------------------------------------------------------------------------
    def _report_step(self, engine: zinf.ZeroInfinityEngine, num_steps: int) -> None:
        """After an engine's ``num_steps``-th optimizer step: its report to the trackers, every
        ``zinf_report_every`` steps (keys ``zinf/...``; ``zinf_<i>/...`` for the i-th of several models)."""
        every = self.zinf_report_every
        report = engine.report()
        if not every or num_steps % every or not self.trackers or report is None:
            return
        metrics = report.metrics()
        index = next(i for i, e in enumerate(self._engines()) if e is engine)
        if index:
            metrics = {f"zinf_{index}/{k.removeprefix('zinf/')}": v for k, v in metrics.items()}
        self.log(metrics, step=num_steps)

    def _built(self) -> list[ZinfModel]:
        """The prepared models whose engine exists (a model prepared alone gets one later)."""
        out = []
        for m in self._zinf_models:
            if isinstance(m, PendingModel):
                if m.built is None:
                    continue
                m = m.built
            out.append(m)
        return out

    def _engines(self) -> list[zinf.ZeroInfinityEngine]:
        return [m.engine for m in self._built()]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engines = self._engines()
        if not engines:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)
        loss = loss / self.gradient_accumulation_steps
        if len(engines) == 1:
            engines[0].backward(loss, **kwargs)
            return None
        if any(e.loss_scaler is not None for e in engines):
            raise UnsupportedModelError("zinf: fp16 loss scaling with several prepared models is not supported; "
                                        "use bf16 or one model.")
        with contextlib.ExitStack() as scope:  # each engine's frame and clean-up, as its own backward has
            for engine in engines:
                scope.enter_context(engine.backward_scope())
            loss.backward(**kwargs)
        return None

    def _engine_of(self, parameters: Iterable[torch.Tensor]) -> zinf.ZeroInfinityEngine | None:
        params = list(parameters)
        ids = {id(p) for p in params}
        for engine in self._engines():
            mine = {id(p) for p in engine.params}
            if ids & mine:
                trainable = {id(p) for p in engine.params if p.requires_grad}
                if not trainable <= ids or not ids <= mine:
                    raise UnsupportedModelError(
                        "zinf: clip_grad_norm_ clips the global norm of one whole model (every rank holds a slice of "
                        "each gradient); pass model.parameters() (or all of its trainable parameters).")
                return engine
        return None

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = list(parameters)
        engine = self._engine_of(params)
        if engine is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"zinf: clip_grad_norm_(norm_type={norm_type}) is not supported; use norm_type=2.")
        return engine.clip_grad_norm_(float(max_norm))

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        params = list(parameters)
        if self._engine_of(params) is not None:
            raise UnsupportedModelError("zinf: clip_grad_value_ is not supported (each rank holds 1/world of every "
                                        "gradient). Use accelerator.clip_grad_norm_(model.parameters(), max_norm).")
        super().clip_grad_value_(params, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """The engine unscales inside clipping and its step; other optimizers as Accelerate does."""
        if optimizer is None:
            optimizer = [o for o in self._optimizers if not isinstance(o, ZinfOptimizer)]
        elif not isinstance(optimizer, (list, tuple)):
            optimizer = [optimizer]
        others = [o for o in optimizer if not isinstance(o, ZinfOptimizer)]
        if others:
            super().unscale_gradients(others)

    # -- models out ----------------------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        if _is_zinf(model):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def _zinf_engine(self, model: nn.Module) -> zinf.ZeroInfinityEngine | None:
        if _is_zinf(model):
            return model.engine
        for m in self._zinf_models:  # the unwrapped module of a prepared model
            if m.module is model:
                return m.engine
        return None

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded, fp32) state dict on the main process, ``{}`` on the others; every rank must call it."""
        engine = self._zinf_engine(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        return engine.full_state_dict(rank0_only=True)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """safetensors files as Accelerate writes them (``model.safetensors`` or numbered shards and an index),
        streamed one parameter group at a time; every rank must call it, the main process writes."""
        engine = self._zinf_engine(model)
        if engine is None or not safe_serialization:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        from zinf.checkpoint import save_safetensors

        save_safetensors(engine, save_directory, max_shard_size=max_shard_size)
        return None

    # -- training state --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _without_zinf(self) -> Iterator[None]:
        """Accelerate's own save/load of everything but zinf models and optimizers (they have their own files)."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not _is_zinf(m)]
        self._optimizers = [o for o in optimizers if not isinstance(o, ZinfOptimizer)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's files (schedulers, samplers, RNG, custom objects, the step) plus each engine's
        per-rank shard files (weights, optimizer state, loss scaler) under ``<dir>/zinf_model[_i]``."""
        with self._without_zinf():
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        for i, engine in enumerate(self._engines()):
            engine.save_checkpoint(os.path.join(location, _ENGINE_DIR if i == 0 else f"{_ENGINE_DIR}_{i}"))
        self.wait_for_everyone()
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        input_dir = self._resolve_input_dir(input_dir)
        with self._without_zinf():
            super().load_state(input_dir, load_kwargs, **kwargs)
        for i, engine in enumerate(self._engines()):
            engine.load_checkpoint(os.path.join(input_dir, _ENGINE_DIR if i == 0 else f"{_ENGINE_DIR}_{i}"))

    def _resolve_input_dir(self, input_dir: str | None) -> str:
        if input_dir is not None:
            return os.path.expanduser(input_dir)
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"(\d+)(?=[^\d]*$)", f)[0]))
        return os.path.join(root, folders[-1])

    def end_training(self) -> None:
        """Finish background optimizer work and release each engine's offload files and buffers (the models
        cannot be called afterwards), then Accelerate's own end (trackers, process group)."""
        for model in self._built():
            model.close()
        super().end_training()


class _ReportingOptimizer(ZinfOptimizer):
    """A :class:`ZinfOptimizer` that tells its Accelerator after each optimizer step (for the step report)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: zinf.ZeroInfinityEngine,
                 after_step: Callable[[zinf.ZeroInfinityEngine, int], None]) -> None:
        super().__init__(optimizer, engine)
        self._after_step = after_step
        self.num_steps = 0  # optimizer steps taken (skipped fp16 overflow steps included)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = super().step(closure)
        if self.gradient_state.sync_gradients:
            self.num_steps += 1
            self._after_step(self.engine, self.num_steps)
        return loss


def _without_optimizer_offload(config: zinf.ZeroConfig) -> zinf.ZeroConfig:
    """The config of the engine of a model called before its optimizer was prepared: with no optimizer there is no
    optimizer state to offload (and the placement refuses an offloaded optimizer it is not given), so
    ``offload.optimizer`` is "device" and the settings that only an offloaded optimizer takes are their defaults; the
    parameters stay where the config puts them."""
    if config.offload.optimizer == "device":
        return config
    offload = dataclasses.replace(config.offload, optimizer="device", grads="auto", step_during_backward=False,
                                  optimizer_device_fraction=0.0)
    return dataclasses.replace(config, offload=offload, optimizer_storage="fp32")


def _close_inference_engine(pending: PendingModel) -> None:
    """A model prepared alone and called before its optimizer was prepared (``Trainer.evaluate()`` before ``train()``:
    Trainer prepares the model alone to evaluate, then only the optimizer to train) got an engine for inference. That
    engine is closed so that ``resolve`` builds it again with the optimizer over the same groups (the parameters stay
    partitioned, their values in the groups). Shards an offloading placement took (``offload.params`` "cpu" or
    "nvme") cannot pass to a second engine: refused, with the fix."""
    assert pending.built is not None
    params_tier = pending.built.engine.config.offload.params
    if params_tier != "device":
        raise UnsupportedModelError(
            f"zinf: this model was called before its optimizer was prepared, so its engine was built for inference "
            f"with its parameter shards offloaded (offload.params='{params_tier}'), and an engine with the optimizer "
            "cannot take them over. Prepare the model and its optimizer before the first call: model, optimizer = "
            "accelerator.prepare(model, optimizer) (with transformers' Trainer: train() before evaluate()), or set "
            "offload.params: device.")
    log.info("zinf: the model's optimizer came after a call; its inference engine is built again with it")
    pending.built.close()
    pending.built = None


def _is_zinf(model: Any) -> bool:
    return isinstance(model, (ZinfModel, PendingModel))
