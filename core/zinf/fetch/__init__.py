"""Moving parameters: shard -> device -> all-gathered full parameter, and back."""

from zinf.fetch.comm import Comm, default_device

__all__ = ["Comm", "default_device"]
