"""``Trainer(strategy="zero_infinity")``: Lightning's DDP launching and collectives, zinf's training.

The DDP base gives the process launch (subprocess script launcher, or spawn), the process group
(gloo on CPU, NCCL on CUDA), the distributed sampler and ``reduce``/``all_gather`` for
``self.log(sync_dist=True)``. Everything about the model goes to one ``zinf.ZeroInfinityEngine``
built in ``setup``: partitioning, forward/backward, clipping, the optimizer step and checkpoints.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Mapping

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

import zinf
from lightning_zinf._shared import (
    build_engine, lightning_precision_name, module_names, offload_preset, register_names, resolve_config,
    with_precision,
)
from lightning_zinf.precision import ZeroInfinityPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ZeroInfinityStrategy"]

log = logging.getLogger(__name__)

# what the engine's own checkpoint holds instead of Lightning's copies
_ENGINE_KEYS = ("state_dict", "optimizer_states")


class ZeroInfinityStrategy(DDPStrategy):
    """ZeRO-Infinity for ``lightning.pytorch``.

    Args:
        config: the engine's settings: a ``zinf.ZeroConfig``, a dict or an OmegaConf ``DictConfig``
            (``None``: defaults). ``precision`` may come from here or from ``Trainer(precision=...)``.
        start_method: how the ranks are started, as for ``strategy="ddp"`` ("popen", "spawn", ...).
        report_every_n_steps: how often rank 0 sends the engine's step report (``zinf.StepReport.metrics()``:
            ``zinf/compute``, ``zinf/all_gather``, ``zinf/bytes_cpu``, ``zinf/io_hidden_share``, ...) to the
            Trainer's loggers; ``None`` (default): the Trainer's ``log_every_n_steps``; 0: never.

    The remaining arguments are the usual plumbing Lightning fills in (devices, cluster environment,
    checkpoint IO, process group backend and timeout).
    """

    strategy_name = "zero_infinity"

    def __init__(
        self,
        config: zinf.ZeroConfig | Mapping[str, Any] | None = None,
        *,
        start_method: str = "popen",
        report_every_n_steps: int | None = None,
        accelerator: "pl.accelerators.Accelerator | None" = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if report_every_n_steps is not None and report_every_n_steps < 0:
            raise ValueError(f"zero_infinity: report_every_n_steps={report_every_n_steps} must be >= 0 (0 turns the "
                             "step report off; None follows Trainer(log_every_n_steps=...)).")
        self.report_every_n_steps = report_every_n_steps
        self.zero_config = resolve_config(config)  # read by the precision setter during super().__init__
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,  # type: ignore[arg-type]
        )
        self.engine: zinf.ZeroInfinityEngine | None = None

    # -- precision: whatever Lightning hands us becomes our plugin + the engine's precision ----------
    @property
    @override
    def precision_plugin(self) -> ZeroInfinityPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroInfinityPrecision(lightning_precision_name(self.zero_config))
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        self.zero_config = with_precision(self.zero_config, str(plugin.precision))
        if not isinstance(plugin, ZeroInfinityPrecision):
            plugin = ZeroInfinityPrecision(str(plugin.precision))
        self._precision_plugin = plugin

    # -- model construction -----------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs here: every module is partitioned as soon as it is built."""
        with zinf.Init(self.zero_config, device=self.root_device):
            yield

    @override
    def model_to_device(self) -> None:
        """The engine places the shards; the full model is never moved."""

    # -- setup / teardown -------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        _check_trainer(trainer)
        module = self.lightning_module
        if type(module).backward is not LightningModule.backward:
            log.warning("zero_infinity: LightningModule.backward is overridden; the engine runs backward itself "
                        "and does not call it.")
        if self.engine is not None:  # a second fit/validate/test: same partitioned parameters, fresh hooks
            self.engine.close()
        if self._layer_sync is not None:
            raise MisconfigurationException(
                "zero_infinity: Trainer(sync_batchnorm=True) is not supported: the engine's collectives and "
                "SyncBatchNorm's would share the process group unordered. Remove sync_batchnorm (each rank then "
                "normalizes over its own batch), or use a normalization without batch statistics (LayerNorm, GroupNorm)."
            )
        self.optimizers, self.lr_scheduler_configs = [], []
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.engine = build_engine(module, self.optimizers, self.zero_config, self.root_device)
        self.model = self.engine.module
        self.precision_plugin.engine = self.engine
        self.setup_precision_plugin()
        _update_properties(module, device=self.root_device)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"zero_infinity: configure_optimizers returned {len(self.optimizers)} optimizers; the engine steps "
                "exactly one. Return one optimizer (use parameter groups for different hyper-parameters)."
            )

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()  # hooks off; parameters stay partitioned (see docs/lightning.md)
        self.model = self.lightning_module
        # not super().teardown(): the base moves the model to the CPU, which the engine owns
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- the steps: every call goes through engine.forward ----------------------------------------
    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None, "zero_infinity: setup() has not run"
        return self.engine(method, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._run("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run("predict_step", *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_report()
        return output

    def _log_report(self) -> None:
        """Send the step report to the Trainer's loggers on rank 0, every ``report_every_n_steps`` optimizer
        steps, on the row Lightning uses for this step's ``self.log`` values."""
        assert self.lightning_module is not None and self.engine is not None
        trainer = self.lightning_module.trainer
        if not trainer.loggers or not self.is_global_zero:
            return
        every = trainer.log_every_n_steps if self.report_every_n_steps is None else self.report_every_n_steps
        report = self.engine.report()
        # global_step counts this step only once the step returns: (global_step + 1) is this step's number,
        # as in Lightning's own should_update_logs
        if not every or report is None or (trainer.global_step + 1) % every:
            return
        metrics = report.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def block_backward_sync(self) -> AbstractContextManager:  # type: ignore[override]
        """Gradients accumulate in the engine's shards; there is no DDP sync to skip."""
        return nullcontext()

    # -- checkpoints: a directory of per-rank shards, Lightning's state in the client state ---------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its shards

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores the optimizer state with the shards

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are saved by the engine, one shard per rank

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # the optimizer state is saved by the engine, one shard per rank

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("zero_infinity: save_checkpoint(storage_options=...) is not supported; each rank writes "
                            "its own shard file into the checkpoint directory.")
        assert self.engine is not None
        client_state = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
        self.engine.save_checkpoint(str(filepath), client_state=client_state)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.engine is not None
        path = Path(checkpoint_path)
        if path.is_dir():  # Lightning's weights_only=False is the user saying the file is trusted
            return self.engine.load_checkpoint(str(path), allow_pickle=True if weights_only is False else None)
        # an ordinary single-file Lightning checkpoint (e.g. one made by convert_to_lightning_checkpoint):
        # weights only, written into the shards by load_model_state_dict
        log.warning("zero_infinity: %s is a single file; loading its weights only (no optimizer state).", path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint.get("state_dict")
        if not state:
            return  # a sharded checkpoint: the engine already loaded the weights in load_checkpoint
        assert self.lightning_module is not None
        with zinf.GatheredParameters(self.lightning_module, modifier_rank=0):
            self.lightning_module.load_state_dict(module_names(state, self.lightning_module), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded the optimizer state together with the shards."""

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.barrier("zero_infinity.remove_checkpoint")  # every rank has finished writing it
        super().remove_checkpoint(filepath)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls, ZeroInfinityOffloadStrategy)


class ZeroInfinityOffloadStrategy(ZeroInfinityStrategy):
    """The offload presets: "zero_infinity_offload" (CPU) and "zero_infinity_nvme" (ZINF_NVME_PATHS)."""

    def __init__(self, config: Any = None, *args: Any, preset: str = "zero_infinity_offload", **kwargs: Any) -> None:
        super().__init__(offload_preset(preset, config), *args, **kwargs)


def _check_trainer(trainer: "pl.Trainer") -> None:
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
        raise MisconfigurationException(
            "zero_infinity: gradient_clip_algorithm='value' is not supported (each rank holds 1/world of every "
            "gradient). Use gradient_clip_algorithm='norm' (the default)."
        )
