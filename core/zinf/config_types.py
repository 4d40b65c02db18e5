"""Config values checked against the config dataclasses' own annotations.

[Note: config types] Every setting is checked by its declared type before any range or choice is: the
rules come from the field annotations (``int``, ``float``, ``bool``, ``str``, ``list[...]``, a nested
config dataclass), not from a table per key. Nothing is converted from a string: ``"1.0"`` for a
number is refused with the fix (write 1.0 without quotes), never read as 1.0, and ``"/mnt/a"`` for a
list is refused, never read one character per item. ``bool`` is refused where an integer or a number
is expected (Python counts True as 1). The only conversions are lossless: an int where a float is
declared becomes that float, and a tuple (or an OmegaConf ListConfig) becomes a list.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from zinf.errors import ConfigError

__all__ = ["check_types", "sections"]

_WHAT = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_PLURAL = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}


def check_types(config: Any, prefix: str) -> None:
    """Refuse the first field of the dataclass instance ``config`` whose value is not of its declared type,
    with a ConfigError naming the key (``prefix`` + field name), the value, its type, the expected type and
    the fix; apply the lossless conversions of [Note: config types] to the others."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        checked = _check(prefix + f.name, value, hints[f.name])
        if checked is not value:
            setattr(config, f.name, checked)


def sections(cls: type) -> dict[str, type]:
    """The fields of the config dataclass ``cls`` that are config dataclasses themselves, by name."""
    return {name: hint for name, hint in _hints(cls).items() if dataclasses.is_dataclass(hint)}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(key: str, value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            example = json.dumps([value]) if isinstance(value, str) else "[...]"
            _refuse(key, value, f"a list of {_PLURAL[item]} ({_name(hint)})", f"Write it as a list, e.g. {example}.")
        return [_check(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            keys = [f.name for f in dataclasses.fields(hint)]
            _refuse(key, value, f"a mapping of {key} settings ({hint.__name__})",
                    f"Write it as a section, {key}: {{key: value, ...}}, with keys among {keys}, or leave it out.")
        return value
    is_bool = isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
    if hint is int and isinstance(value, numbers.Integral) and not is_bool:
        return int(value)  # numpy and other integer types: the same whole number
    if hint is float and isinstance(value, numbers.Real) and not is_bool:
        return float(value)  # an int, or numpy's float32/float64: lossless to Python float
    if hint is str and isinstance(value, str):
        return value
    if hint is bool and is_bool:
        return bool(value)
    if hint not in _WHAT:  # a new field with a type these rules do not cover yet
        raise TypeError(f"zinf config: no type rule for '{key}' of type {hint!r}; add one to zinf/config_types.py")
    _refuse(key, value, f"{_WHAT[hint]} ({hint.__name__})", _fix(value, hint))


def _fix(value: Any, hint: type) -> str:
    if hint is bool:
        return "Write true or false without quotes." if isinstance(value, str) else "Write true or false."
    if hint is str:
        return "Write it as a string (in quotes)."
    if isinstance(value, bool):
        return f"Write {_WHAT[hint]}; true/false is not a number here."
    number = _as_number(value)
    quotes = " without quotes" if isinstance(value, str) else ""
    if number is None:
        return f"Write {_WHAT[hint]}, e.g. {1 if hint is int else 1.0}."
    if hint is float:
        return f"Write {number!r}{quotes}."
    if not math.isfinite(number):
        return "Write a whole number."
    if number.is_integer():
        return f"Write {int(number)}{quotes}" + ("" if quotes else " (no decimal point)") + "."
    return f"Write a whole number, e.g. {int(number)}."


def _as_number(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint)


def _refuse(key: str, value: Any, expected: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"zinf config: '{key}' = {value!r} is not allowed; expected {expected}, "
                      f"got {type(value).__name__}. {fix}")
