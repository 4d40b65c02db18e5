"""What the planner knows about a model: its flat groups (one per owning module, as the engine makes them) and
the shapes that set its compute (layers, hidden size, sequence length).

Three ways in, all without allocating a weight: a module (built on the meta device, or any built module: only
shapes are read), a transformers config (the model is built on the meta device from it, no download), or a
parameter count with optional layer shapes (a GPT-like stack of that size is assumed).
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from zinf.errors import ConfigError
from zinf.param.four_bit import convertible_linears

__all__ = ["PlanError", "check_at_least", "GroupShape", "ModelSpec", "spec_from_module", "spec_from_hf", "spec_from_params",
           "spec_from_factory", "FOUR_BIT_BLOCK", "QLORA_BITS"]

FOUR_BIT_BLOCK = 64  # elements per scale of a 4-bit group (bitsandbytes' block size)
QLORA_BITS = {"4bit": 4, "8bit": 8}  # ``--qlora``: the base's format


class PlanError(ConfigError):
    """Bad planner input: the message names the input, the value and what to give instead."""


@dataclass(frozen=True)
class GroupShape:
    """One flat group: the direct parameters of one module (tied parameters counted once, with their first owner)."""

    name: str
    numel: int
    trainable: bool = True
    matmul: bool = True  # its weights take part in matrix products (False: position embeddings, norms' scales)
    # a QLoRA base's linear weight: 4-bit codes and a scale per block ([Note: 4-bit shards]), or 8-bit codes and a
    # scale per row of ``row`` elements ([Note: 8-bit shards]); 0: stored at the run's storage dtype
    bits: int = 0
    row: int = 0


@dataclass(frozen=True)
class ModelSpec:
    groups: tuple[GroupShape, ...]
    source: str
    num_layers: int | None = None
    hidden: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def matmul_numel(self) -> int:
        """Parameters that each token multiplies once in forward (what ``6 * params * tokens`` counts)."""
        return sum(g.numel for g in self.groups if g.matmul)

    @property
    def largest_group_numel(self) -> int:
        return max((g.numel for g in self.groups), default=0)

    def shard_numels(self, world: int) -> list[int]:
        """Per group, this rank's shard (the flat vector padded to a multiple of ``world``, see [Note: flat
        layout] in zinf/param/layout.py)."""
        return [max(1, math.ceil(g.numel / world)) for g in self.groups]

    def shard_bytes(self, world: int, itemsize: int) -> list[int]:
        """Per group, this rank's shard at rest: ``itemsize`` bytes an element, or a quantized group's codes and fp32
        scales (its shard rounded up to whole blocks of ``FOUR_BIT_BLOCK``, or to whole rows)."""
        out = []
        for g, n in zip(self.groups, self.shard_numels(world)):
            if g.bits == 4:
                out.append(-(-n // FOUR_BIT_BLOCK) * (FOUR_BIT_BLOCK // 2 + 4))
            elif g.bits == 8:
                out.append(-(-n // g.row) * (g.row + 4))
            else:
                out.append(n * itemsize)
        return out

    def quantized(self, rows: Mapping[str, int], bits: int) -> "ModelSpec":
        """QLoRA's shape: every group frozen, those named in ``rows`` in ``bits`` bits (with the elements of a row:
        an 8-bit weight's scales are a row's); the adapters' few parameters not counted."""
        groups = tuple(GroupShape(g.name, g.numel, False, g.matmul, bits if g.name in rows else 0, rows.get(g.name, 0))
                       for g in self.groups)
        return ModelSpec(groups, f"{self.source}, {bits}-bit base", self.num_layers, self.hidden, self.seq_len,
                         self.vocab, self.notes)

    def describe(self) -> str:
        shape = ", ".join(f"{k} {v}" for k, v in (("layers", self.num_layers), ("hidden", self.hidden),
                                                   ("seq", self.seq_len), ("vocab", self.vocab)) if v)
        return f"{self.source}: {self.numel / 1e6:,.1f}M parameters in {len(self.groups)} groups" + (f" ({shape})" if shape else "")


def _direct(module: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in module.named_parameters(recurse=False) if p is not None]


def spec_from_module(module: nn.Module, source: str | None = None, seq_len: int | None = None) -> ModelSpec:
    """The engine's grouping (zinf/param/partition.py) from shapes alone: each parameter belongs to the first module
    that holds it, and each module's own parameters form one group."""
    if not isinstance(module, nn.Module):
        raise PlanError(f"zinf plan: expected an nn.Module (built on the meta device), found {type(module).__name__}.")
    owner: dict[int, int] = {}
    for m in module.modules():
        for p in _direct(m):
            owner.setdefault(id(p), id(m))
    linear_params = {id(p) for m in module.modules() if isinstance(m, nn.Linear) for p in _direct(m)}
    groups = []
    for name, m in module.named_modules():
        mine = [p for p in dict.fromkeys(_direct(m)) if owner[id(p)] == id(m)]
        if not mine:
            continue
        numel = sum(p.numel() for p in mine)
        # an embedding's table is multiplied only when it is tied to a linear layer (a tied output head)
        matmul = not isinstance(m, (nn.Embedding, nn.LayerNorm)) or any(id(p) in linear_params for p in mine)
        if type(m).__name__.endswith(("Norm", "RMSNorm")):
            matmul = False
        groups.append(GroupShape(name or type(m).__name__, numel, any(p.requires_grad for p in mine), matmul))
    if not groups:
        raise PlanError(f"zinf plan: the module {type(module).__name__} has no parameters; give a model with weights.")
    lists = [len(m) for m in module.modules() if isinstance(m, nn.ModuleList)]
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    hidden = max(embeddings, key=lambda e: e.num_embeddings).embedding_dim if embeddings else None
    vocab = max(e.num_embeddings for e in embeddings) if embeddings else None
    return ModelSpec(tuple(groups), source or type(module).__name__, num_layers=max(lists) if lists else None,
                     hidden=hidden, seq_len=seq_len, vocab=vocab)


def spec_from_hf(config: Any, kwargs: Mapping[str, Any] | None = None, seq_len: int | None = None,
                 qlora: str | None = None) -> ModelSpec:
    """A transformers causal LM built on the meta device from ``config``: a config object, or a model type
    (``"gpt2"``, ``"llama"``, ...) with ``kwargs`` for its config class. Nothing is downloaded. ``qlora`` ("4bit" or
    "8bit"): the base frozen, its linear layers in 4 or 8 bits where ``BitsAndBytesConfig(load_in_4bit=True)`` or
    ``load_in_8bit=True`` would put them (transformers' own rule)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    except ImportError as exc:  # pragma: no cover - transformers is a test extra
        raise PlanError(f"zinf plan: --hf-config needs transformers (pip install transformers): {exc}") from exc
    if isinstance(config, str):
        model_type = config
        try:
            config = AutoConfig.for_model(config, **dict(kwargs or {}))
        except ValueError as exc:
            raise PlanError(f"zinf plan: --hf-config {config!r} is not a transformers model type ({exc}). Give one "
                            "such as 'gpt2', 'llama', 'mistral'.") from None
        except TypeError as exc:
            raise PlanError(f"zinf plan: --hf-kwargs {dict(kwargs or {})} do not fit the {config!r} config: {exc}") from None
        if kwargs:
            _check_config_keys(type(config)(), config, kwargs, model_type)
    elif not isinstance(config, PretrainedConfig):
        raise PlanError(f"zinf plan: expected a transformers config or model type, found {type(config).__name__}.")
    elif kwargs:
        _check_config_keys(type(config)(), type(config)(**dict(kwargs)), kwargs, type(config).__name__)
        config.update(dict(kwargs))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    spec = spec_from_module(model, source=f"transformers {type(model).__name__}")
    if qlora:
        spec = spec.quantized({name: m.in_features for name, m in convertible_linears(model)}, QLORA_BITS[qlora])
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    positions = getattr(config, "max_position_embeddings", None)
    return ModelSpec(spec.groups, spec.source, num_layers=layers or spec.num_layers, hidden=hidden or spec.hidden,
                     seq_len=seq_len or positions, vocab=getattr(config, "vocab_size", spec.vocab))


def _check_config_keys(defaults: Any, built: Any, kwargs: Mapping[str, Any], name: str) -> None:
    """Each key of ``kwargs`` is a setting of the config: transformers keeps a key it does not know as a new
    attribute without a word (the plan would be of the default model), so a key that ``built`` (the config made with
    ``kwargs``) holds as an attribute its ``defaults`` lack is refused. Aliases (``attribute_map``) and keys its
    ``__init__`` consumes (``rope_theta``, ``torch_dtype``) are no new attributes and pass."""
    import difflib

    extra = set(vars(built)) - set(vars(defaults))
    known = set(vars(defaults)) | set(getattr(defaults, "attribute_map", {}) or {})
    for key in kwargs:
        if key in extra and key not in known:
            near = difflib.get_close_matches(str(key), sorted(k for k in known if not k.startswith("_")), n=3)
            hint = f"did you mean {', '.join(repr(k) for k in near)}?" if near else "see the config class's attributes."
            raise PlanError(f"zinf plan: --hf-kwargs key {key!r} is not a setting of the {name!r} config "
                            f"({type(defaults).__name__}); {hint}")


def spec_from_params(numel: float, num_layers: int | None = None, hidden: int | None = None, vocab: int | None = None,
                     seq_len: int | None = None) -> ModelSpec:
    """A GPT-like stack of ``numel`` parameters: per layer two norms and four linear layers (qkv, proj, fc, out:
    12 h^2 + 13 h parameters), the rest one embedding table tied to the output head. Shapes not given are
    assumed: hidden = 128 x layers (GPT-3's aspect ratio) solved from ``numel``."""
    if not isinstance(numel, (int, float)) or isinstance(numel, bool) or not math.isfinite(numel):
        raise PlanError(f"zinf plan: --params = {numel} is not a parameter count; expected a finite number >= 1 such "
                        "as 1.3e9.")
    check_at_least(1, **{"--layers": num_layers, "--hidden": hidden, "--vocab": vocab, "--seq": seq_len})
    numel = int(numel)
    if numel < 1:
        raise PlanError(f"zinf plan: --params = {numel} is not a parameter count; give a positive number such as 1.3e9.")
    notes = []
    if hidden is None and num_layers is None:
        num_layers = max(1, round((numel / (12 * 128**2)) ** (1 / 3)))
        notes.append(f"layers and hidden size not given: assumed {num_layers} layers, hidden = 128 x layers")
    if hidden is None:
        assert num_layers is not None
        hidden = max(64, int(math.sqrt(numel / (12 * num_layers))) // 64 * 64)
    if num_layers is None:
        num_layers = max(1, round(numel / (12 * hidden * hidden)))
    h = hidden
    per_layer = [("ln1", 2 * h, False), ("qkv", 3 * h * h + 3 * h, True), ("proj", h * h + h, True),
                 ("ln2", 2 * h, False), ("fc", 4 * h * h + 4 * h, True), ("out", 4 * h * h + h, True)]
    groups = [GroupShape(f"layers.{i}.{n}", k, True, mm) for i in range(num_layers) for n, k, mm in per_layer]
    rest = numel - sum(g.numel for g in groups)
    if rest < 0:
        raise PlanError(f"zinf plan: {num_layers} layers of hidden size {hidden} hold {numel - rest:,} parameters, more "
                        f"than --params = {numel:,}; lower --layers/--hidden or raise --params.")
    if rest > 0:
        groups.insert(0, GroupShape("embedding", rest, True, True))
        vocab = vocab or max(1, rest // h)
    return ModelSpec(tuple(groups), f"{numel / 1e9:.3g}B-parameter GPT-like model", num_layers=num_layers, hidden=hidden,
                     seq_len=seq_len, vocab=vocab, notes=tuple(notes))


def _import_factory(target: str) -> Callable[..., Any]:
    mod_name, sep, attr = target.partition(":")
    if not sep or not mod_name or not attr:
        raise PlanError(f"zinf plan: --module {target!r} must be 'package.module:factory' (a function or class "
                        "that returns the model).")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise PlanError(f"zinf plan: --module {target!r}: cannot import {mod_name!r} ({exc}); check the name and that "
                        "it is on PYTHONPATH.") from None
    fn = mod
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise PlanError(f"zinf plan: --module {target!r}: {mod_name!r} has no attribute {part!r}.")
        fn = getattr(fn, part)
    if not callable(fn):
        raise PlanError(f"zinf plan: --module {target!r} is not callable; point it at a function returning the model.")
    return fn  # type: ignore[return-value]


def spec_from_factory(target: str, kwargs: Mapping[str, Any] | str | None = None, seq_len: int | None = None) -> ModelSpec:
    """Call ``package.module:factory(**kwargs)`` under the meta device and read the module it returns."""
    if isinstance(kwargs, str):
        kwargs = parse_json_kwargs(kwargs, "--module-kwargs")
    fn = _import_factory(target)
    with torch.device("meta"):
        model = fn(**dict(kwargs or {}))
    return spec_from_module(model, source=target, seq_len=seq_len)


def check_at_least(low: int, **flags: Any) -> None:
    """Each given (not None) value of ``flags`` (named as on the command line) is a whole number >= ``low``."""
    for flag, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            what = "a count" if low >= 1 else "a number of bytes"
            raise PlanError(f"zinf plan: {flag} = {value!r} is not allowed; expected {what} >= {low} (a whole number).")


def parse_json_kwargs(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"zinf plan: {flag} is not valid JSON ({exc}); give an object such as '{{\"n_layer\": 4}}'.") from None
    if not isinstance(value, dict):
        raise PlanError(f"zinf plan: {flag} must be a JSON object, found {type(value).__name__}.")
    return value

