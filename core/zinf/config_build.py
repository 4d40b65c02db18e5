"""Building config dataclasses from mappings, and the checks every config runs when it is built.

``build_config`` turns a dict, a parsed YAML file, an OmegaConf ``DictConfig`` or a dataclass into a config
dataclass, refusing an unknown key with the closest valid one; ``Checked`` is the base of the config dataclasses
(each validates itself when constructed, whichever way it is built) and ``require`` the error a validation raises.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from zinf.config_types import sections
from zinf.errors import ConfigError

__all__ = ["Checked", "require", "build_config", "build_from_mapping", "to_plain_dict"]


class Checked:
    """Base of the config dataclasses: each validates itself when constructed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        raise NotImplementedError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"zinf config: '{key}' = {value!r} is not allowed; expected {allowed}.")


def to_plain_dict(values: Any) -> dict[str, Any]:
    try:  # OmegaConf is a dependency, but keep this module importable without it
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import MissingMandatoryValue

        if isinstance(values, DictConfig):
            try:
                return dict(OmegaConf.to_container(values, resolve=True, throw_on_missing=True))  # type: ignore[arg-type]
            except MissingMandatoryValue as exc:  # a ??? left unset, e.g. the nvme preset's nvme_paths
                key = exc.full_key or "?"
                raise ConfigError(
                    f"zinf config: '{key}' has no value (??? in the config: the config or preset leaves it to you). "
                    f"Set it, e.g. {key}=... on the Hydra command line or in your config file.") from None
    except ImportError:  # pragma: no cover
        pass
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        return dataclasses.asdict(values)
    if not isinstance(values, Mapping):
        raise ConfigError(f"zinf config: expected a mapping of settings, found {type(values).__name__}")
    return dict(values)


def build_config(cls: type, values: Any, prefix: str = "") -> Any:
    """Build the config dataclass ``cls`` (an application's own too) from a mapping, a DictConfig or a dataclass,
    as ``ZeroConfig.from_dict`` does: an unknown key is a ConfigError naming ``prefix`` + the key and the closest
    valid one, nested config dataclasses are built the same way, and ``cls`` checks its values when constructed."""
    return build_from_mapping(cls, to_plain_dict(values), prefix)


def build_from_mapping(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    nested = sections(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"zinf config: unknown key '{prefix}{key}'.{hint} Valid keys here: {sorted(fields)}."
            )
        if key in nested and isinstance(value, Mapping):
            value = build_from_mapping(nested[key], value, prefix=f"{prefix}{key}.")
        kwargs[key] = value  # anything else of the wrong type is refused by check_types, naming the key
    return cls(**kwargs)
