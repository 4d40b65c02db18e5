"""The exceptions zinf raises. Each message says what was expected, what was found, and the fix."""

from __future__ import annotations

__all__ = ["ZinfError", "ConfigError", "UnsupportedModelError", "CollectiveMismatchError", "CollectiveTimeoutError", "PartlyLoadedError",
           "CheckpointError"]


class ZinfError(RuntimeError):
    """Base class of every error zinf raises on purpose."""


class ConfigError(ZinfError, ValueError):
    """A configuration key or value is wrong; the message names the key, the value and the allowed ones."""


class UnsupportedModelError(ZinfError):
    """The model or optimizer uses a pattern the engine cannot partition; the message names the fix."""


class CollectiveMismatchError(ZinfError):
    """Ranks disagree about something they must agree on (world size, parameter layout, trace)."""


class CollectiveTimeoutError(ZinfError):
    """A collective waited ``collective_timeout_s`` for the other ranks; the message names the ones that did not
    answer."""


class SharedMemoryTimeout(ZinfError, RuntimeError):
    """A rank of this host did not post its part of a shared-memory collective within the timeout (see [Note:
    same-host collectives] in zinf/runtime/same_host.py); the collective watchdog reports it as a
    :class:`CollectiveTimeoutError`."""


class CheckpointError(ZinfError):
    """A checkpoint is missing, incomplete, mixed from several saves, truncated, foreign, or does not fit the
    model/world it is loaded into; or a save failed (then the previous checkpoint is still the current one)."""


class PartlyLoadedError(CheckpointError):
    """A checkpoint load failed after some of the state had streamed in (a checksum failing in a tensor): the
    engine's state is partly replaced, and the engine refuses to train until a load succeeds."""
