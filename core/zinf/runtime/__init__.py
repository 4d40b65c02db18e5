"""The distributed runtime: the process group and the compute device (comm), streams and work in flight (streams),
the collective watchdog, and the two mirror collectives over flat groups: the all-gather of parameter shards
(gather) and the reduce-scatter of gradients into shards (reduce)."""

from zinf.runtime.comm import Comm, default_device
from zinf.runtime.streams import install_rank_filter, streams_for

__all__ = ["Comm", "default_device", "install_rank_filter", "streams_for"]
