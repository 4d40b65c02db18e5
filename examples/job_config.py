"""The main job's settings (examples/train_gpt.py), typed: model, data, train and the zinf section, checked as
one config before anything starts or is written. A misspelt key anywhere is a ConfigError naming the closest
valid key; an impossible value (steps < 1, a head count that does not divide the width, ...) names the setting
and what it accepts."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

import zinf
from zinf.config import build_config
from zinf.config_types import check_types

from gpt import GPTConfig

__all__ = ["JobConfig", "load_job_config"]


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise zinf.ConfigError(f"'{key}' = {value!r} is not allowed; expected {allowed}.")


@dataclass
class ModelSettings(GPTConfig):
    """The GPT's shape (examples/gpt.py's GPTConfig), checked."""

    def __post_init__(self) -> None:
        check_types(self, "model.")
        for key in ("vocab", "block", "n_embd", "n_head", "n_layer"):
            _require(getattr(self, key) >= 1, f"model.{key}", getattr(self, key), "an integer >= 1")
        _require(self.n_embd % self.n_head == 0, "model.n_head", self.n_head,
                 f"a divisor of model.n_embd = {self.n_embd} (each head takes n_embd / n_head of the width)")


@dataclass(kw_only=True)
class DataSettings:
    branching: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self, "data.")
        _require(self.branching >= 1, "data.branching", self.branching, "an integer >= 1 (successors per token)")


@dataclass(kw_only=True)
class TrainSettings:
    steps: int = 80
    batch_per_rank: int = 8
    lr: float = 2.0e-3
    warmup: float = 0.1
    weight_decay: float = 0.1
    out_dir: str = "zinf_run"

    def __post_init__(self) -> None:
        check_types(self, "train.")
        _require(self.steps >= 1, "train.steps", self.steps, "an integer >= 1")
        _require(self.batch_per_rank >= 1, "train.batch_per_rank", self.batch_per_rank, "an integer >= 1")
        _require(self.lr > 0, "train.lr", self.lr, "a number > 0")
        _require(0 <= self.warmup < 1, "train.warmup", self.warmup, "a share of the steps in [0, 1)")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        _require(bool(self.out_dir), "train.out_dir", self.out_dir, "a directory path")


@dataclass(kw_only=True)
class JobConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    # zinf.ZeroConfig's settings, except that offload.params may be "auto" (resolved by train_gpt.py)
    zinf: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        settings = copy.deepcopy(self.zinf)
        offload = settings.get("offload")
        if isinstance(offload, dict):
            if offload.get("params") == "auto":
                offload["params"] = "device"  # checked as a tier it may become
            if not offload.get("nvme_paths") and "nvme" in (offload.get("params"), offload.get("optimizer")):
                offload["nvme_paths"] = ["<temporary>"]  # train_gpt.py makes a temporary directory when none is named
        build_config(zinf.ZeroConfig, settings, prefix="zinf.")


def load_job_config(path: str, overrides: list[str]) -> JobConfig:
    """The YAML file at ``path`` with the ``key=value`` overrides applied, checked as a whole."""
    try:
        base = OmegaConf.load(path)
    except FileNotFoundError:
        raise zinf.ConfigError(f"--config {path!r} does not exist; give a YAML file such as "
                               "examples/configs/gpt_small.yaml (or leave --config out for it).") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    except Exception as exc:  # noqa: BLE001 - OmegaConf's own parse errors, named with the input
        raise zinf.ConfigError(f"cannot read the overrides {overrides} ({exc}); write key=value, "
                               "e.g. train.steps=50 zinf.precision=bf16.") from None
    return build_config(JobConfig, merged)
