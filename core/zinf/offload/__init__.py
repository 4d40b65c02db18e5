"""The Infinity offload engine: parameter shards, fp32 masters and moments on device, CPU or NVMe."""

from zinf.offload.nvme_param_store import NvmeShardStore
from zinf.offload.param_store import CpuShardStore
from zinf.offload.swap import OffloadFileError, OffloadSpaceError, SwapSpace

__all__ = ["CpuShardStore", "NvmeShardStore", "SwapSpace", "OffloadFileError", "OffloadSpaceError"]
