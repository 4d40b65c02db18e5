"""transformers' ``from_pretrained`` builds a partitioned model and loads it with zinf's streaming loader.

[Note: from_pretrained under zinf]
Plain transformers 5 builds the model on the meta device, then reads every weight into each rank. Under zinf it
instead builds the model under ``zinf.Init`` with initialisation turned off (transformers' own ``no_init_weights``;
the placeholders are never compared across ranks), so each module is partitioned as soon as it is built and the
whole model never exists; then every rank reads only its slices from the files (zinf/checkpoint/pretrained.py).
Parameters the files do not hold are initialised by the model's own ``initialize_weights``, gathered, with rank
0's values kept (as DeepSpeed's path does). transformers' loading report, tied weights, ``model.eval()`` and the
generation config work as they are.

It applies when ``from_pretrained`` runs inside ``zinf.Init`` (a user's block, the Accelerate front end's
``init_module()``, Lightning's ``configure_model``), or anywhere once a launcher has called ``enable(config)``
(``zinf launch``): the launcher, not the order of lines in the script, decides. ``from_pretrained`` and four
private methods of ``PreTrainedModel`` are wrapped once (``install``) when zinf's integrations are activated
(entering ``zinf.Init``, building an engine, ``zinf launch``: [Note: integrations are activated, not imported] in
zinf/integrations/__init__.py), or when ``transformers.modeling_utils`` is first imported after that (``watch``);
importing zinf wraps nothing. Each wrapper defers to the original unless a zinf load is running, so nothing changes
for models loaded outside zinf. The transformers versions this follows are those of the ``test`` extra (5.x).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from zinf.checkpoint.pretrained import load_pretrained
from zinf.config import ZeroConfig
from zinf.errors import UnsupportedModelError
from zinf import integrations
from zinf.integrations.after_import import when_imported, wrap_once
from zinf.integrations.quantized import prepare_saved, quantize_base, quantized_format
from zinf.init import Init
from zinf.param.registry import group_of

__all__ = ["install", "watch", "enable", "disable", "enabled", "loading"]

log = logging.getLogger(__name__)

_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("zinf_from_pretrained", default=False)
_SAVED_QUANTIZED: contextvars.ContextVar[Any] = contextvars.ContextVar("zinf_saved_quantized", default=None)
_launch: dict[str, Any] = {"config": None, "start": None}
_originals: dict[str, Any] = {}
_WRAPPED = ("from_pretrained", "get_init_context", "_load_pretrained_model", "_move_missing_keys_from_meta_to_device",
            "_initialize_missing_keys")
_REFUSED = ("device_map", "tp_plan", "tp_size", "distributed_config", "gguf_file")


def enable(config: ZeroConfig, start: Callable[[], None] | None = None) -> None:
    """From now on every ``from_pretrained`` in this process builds a partitioned model with ``config`` (a launcher
    calls this before the user's script runs; it activates all of zinf's integrations, Trainer's too). ``start`` is
    called first when no process group exists yet (a script that loads its model before building its Accelerator or
    Trainer): the launcher joins its ranks there, the way its trainer would, so that the model is partitioned over
    all of them rather than built whole on each."""
    _launch.update(config=config, start=start)
    integrations.activate()
    install()


def disable() -> None:
    _launch.update(config=None, start=None)


def enabled() -> bool:
    """Whether a launcher has called ``enable`` in this process (``zinf launch``: the script's models train on zinf)."""
    return _launch["config"] is not None


def loading() -> bool:
    """Whether a zinf ``from_pretrained`` is running (in this thread / task)."""
    return _LOADING.get()


_MODULE = "transformers.modeling_utils"


def watch() -> None:
    """Install the wrappers now if transformers' model code is loaded, else as soon as it is (called by
    ``zinf.integrations.activate``)."""
    when_imported(_MODULE, install)


integrations.register(watch)


def install() -> bool:
    """Wrap ``PreTrainedModel``'s loading steps once; False when transformers is not installed."""
    return wrap_once(_originals, _MODULE, _wrap)


def _wrap(modeling_utils: Any) -> bool:
    cls = modeling_utils.PreTrainedModel
    missing = [n for n in _WRAPPED if n not in cls.__dict__]
    if missing:  # a transformers release whose loading steps zinf does not know
        log.warning("zinf: transformers %s has no PreTrainedModel.%s; from_pretrained under zinf.Init will refuse to "
                    "build on the meta device instead of loading streaming. Load the model outside zinf.Init (it is "
                    "partitioned when the engine is built), or use a transformers release of zinf's 'test' extra.",
                    getattr(sys.modules.get("transformers"), "__version__", "?"), missing[0])
        return False
    _originals.update(from_pretrained=cls.__dict__["from_pretrained"], get_init_context=cls.__dict__["get_init_context"],
                      load=cls.__dict__["_load_pretrained_model"],
                      move_missing=cls._move_missing_keys_from_meta_to_device,
                      init_missing=cls._initialize_missing_keys)
    cls.from_pretrained = classmethod(_from_pretrained)
    cls.get_init_context = classmethod(_get_init_context)
    cls._load_pretrained_model = staticmethod(_load_pretrained_model)
    cls._move_missing_keys_from_meta_to_device = _move_missing_keys_from_meta_to_device
    cls._initialize_missing_keys = _initialize_missing_keys
    return True


@contextlib.contextmanager
def _loading() -> Iterator[None]:
    token = _LOADING.set(True)
    try:
        yield
    finally:
        _LOADING.reset(token)


def _from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
    original = _originals["from_pretrained"].__func__
    init = Init.current()
    if loading() or (init is None and _launch["config"] is None):
        return original(cls, *args, **kwargs)
    refused = [k for k in _REFUSED if kwargs.get(k) is not None]
    quantized = None
    if kwargs.get("quantization_config") is not None:  # [Note: a 4-bit base] in zinf/integrations/quantized.py
        quantized = quantized_format(kwargs.pop("quantization_config"))
    saved = _saved_quantization(cls, args, kwargs)  # a checkpoint saved in 4 or 8 bits: its config says so
    if saved is not None:
        quantized = saved  # as transformers does, the checkpoint's own quantization wins
    if refused:
        raise UnsupportedModelError(
            f"zinf: from_pretrained({refused[0]}=...) places the weights itself, which zinf does instead (it "
            f"partitions every parameter across ranks and tiers). Drop {refused[0]}, or load outside zinf.Init / "
            "zinf launch.")
    with contextlib.ExitStack() as stack:
        if init is None:
            if _launch["start"] is not None and not (dist.is_available() and dist.is_initialized()):
                _launch["start"]()
            init = stack.enter_context(Init(_launch["config"]))
        stack.enter_context(init.placeholders())
        stack.enter_context(_loading())
        if saved is not None:
            token = _SAVED_QUANTIZED.set((*quantized, init.comm))
            stack.callback(_SAVED_QUANTIZED.reset, token)
        model = original(cls, *args, **kwargs)
    if quantized is not None:
        quantize_base(model, *quantized, init.comm)
    return model


def _saved_quantization(cls: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The 4-bit or 8-bit storage of a checkpoint saved quantized (its config's ``quantization_config``), taken out of the
    config the model is built from (so transformers builds plain ``nn.Linear`` layers): None when there is none."""
    import copy

    from transformers import PretrainedConfig

    config = kwargs.get("config")
    if not isinstance(config, PretrainedConfig):
        if config is not None or not args:
            return None
        if "quantization_config" not in PretrainedConfig.get_config_dict(args[0])[0]:
            return None
        config = cls.config_class.from_pretrained(args[0])
    saved = getattr(config, "quantization_config", None)
    if saved is None:
        return None
    fmt = quantized_format(saved.to_dict() if hasattr(saved, "to_dict") else saved)
    config = copy.deepcopy(config)
    del config.quantization_config
    kwargs["config"] = config
    return fmt


def _get_init_context(cls: Any, *args: Any, **kwargs: Any) -> list[Any]:
    contexts = _originals["get_init_context"].__func__(cls, *args, **kwargs)
    if not loading():
        return contexts
    from transformers import initialization

    # no meta device: zinf.Init partitions each module as it is built; no initialisation: the files' values replace it
    return [c for c in contexts if not (isinstance(c, torch.device) and c.type == "meta")] + [
        initialization.no_init_weights()]


def _partitioned(model: Any) -> bool:
    return any(group_of(p) is not None for p in model.parameters())


def _load_pretrained_model(model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any,
                           *args: Any, **kwargs: Any) -> Any:
    if not (loading() and _partitioned(model)):
        return _originals["load"].__func__(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    saved = _SAVED_QUANTIZED.get()
    if saved is not None:  # empty groups for the files' codes and scales (zinf/checkpoint/four_bit_files.py)
        prepare_saved(model, *saved)
    elif getattr(model, "hf_quantizer", None) is not None:
        raise UnsupportedModelError("zinf: this checkpoint is saved quantized in a way zinf does not read; load the "
                                    "unquantized checkpoint, with BitsAndBytesConfig(load_in_4bit=True) for a 4-bit base.")
    from transformers.utils.loading_report import LoadStateDictInfo

    source = state_dict if state_dict is not None else list(checkpoint_files or [])
    if not source:
        raise UnsupportedModelError("zinf: from_pretrained found neither weight files nor a state dict to load.")
    report = load_pretrained(model, source, strict=False)
    converting = [type(t).__name__ for t in (getattr(load_config, "weight_mapping", None) or [])
                  if type(t).__name__ != "WeightRenaming"]
    if converting and report.missing_keys and report.unexpected_keys:
        raise UnsupportedModelError(
            f"zinf: {type(model).__name__}'s checkpoint needs transformers' weight conversions ({converting[0]}) that "
            f"zinf's streaming loader does not apply: {len(report.missing_keys)} parameters (e.g. "
            f"{report.missing_keys[0]}) are not in the files as named. Load this model outside zinf.Init (it is "
            "partitioned when the engine is built) or convert the checkpoint with save_pretrained first.")
    for name in report.loaded_keys:
        model.get_parameter_or_buffer(name)._is_hf_initialized = True  # transformers' flag: do not initialise
    info = LoadStateDictInfo(missing_keys=set(report.missing_keys), unexpected_keys=set(report.unexpected_keys),
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    return info, None


def _move_missing_keys_from_meta_to_device(self: Any, *args: Any, **kwargs: Any) -> None:
    if loading() and _partitioned(self):
        return  # nothing is on the meta device: zinf.Init built every parameter and buffer
    _originals["move_missing"](self, *args, **kwargs)


def _initialize_missing_keys(self: Any, *args: Any, **kwargs: Any) -> None:
    if not (loading() and _partitioned(self)):
        return _originals["init_missing"](self, *args, **kwargs)
    from zinf.param.gathered import GatheredParameters

    missing = [p for p in {id(v): v for v in self.state_dict(keep_vars=True).values()}.values()
               if isinstance(p, torch.nn.Parameter) and not getattr(p, "_is_hf_initialized", False)]
    if missing:
        log.info("zinf: initialising %d parameters the checkpoint does not hold (rank 0's values)", len(missing))
    with GatheredParameters(missing, modifier_rank=0):
        self.initialize_weights()
