"""The Infinity offload engine: parameter shards, fp32 masters and moments on device, CPU or NVMe."""

from zinf.offload.param_store import CpuShardStore, NvmeShardStore
from zinf.offload.swap import OffloadFileError, OffloadSpaceError, SwapSpace

__all__ = ["CpuShardStore", "NvmeShardStore", "SwapSpace", "OffloadFileError", "OffloadSpaceError"]
