"""Moving parameters: shard -> device -> all-gathered full parameter, and back."""

from zinf.fetch.comm import Comm, default_device
from zinf.fetch.streams import install_rank_filter, streams_for

__all__ = ["Comm", "default_device", "install_rank_filter", "streams_for"]
