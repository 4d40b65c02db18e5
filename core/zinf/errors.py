"""The exceptions zinf raises. Each message says what was expected, what was found, and the fix."""

from __future__ import annotations

__all__ = ["ZinfError", "ConfigError", "UnsupportedModelError", "CollectiveMismatchError"]


class ZinfError(RuntimeError):
    """Base class of every error zinf raises on purpose."""


class ConfigError(ZinfError, ValueError):
    """A configuration key or value is wrong; the message names the key, the value and the allowed ones."""


class UnsupportedModelError(ZinfError):
    """The model or optimizer uses a pattern the engine cannot partition; the message names the fix."""


class CollectiveMismatchError(ZinfError):
    """Ranks disagree about something they must agree on (world size, parameter layout, trace)."""
