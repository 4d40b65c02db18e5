"""The Infinity offload engine: parameter shards, fp32 masters and moments on device, CPU or NVMe."""

from zinf.offload.optimizer import OffloadedAdam
from zinf.offload.param_store import CpuParamStore, DeviceParamStore, NvmeParamStore, ParamStore
from zinf.offload.swap import OffloadFileError, OffloadSpaceError, SwapSpace

__all__ = ["OffloadedAdam", "ParamStore", "DeviceParamStore", "CpuParamStore", "NvmeParamStore", "SwapSpace",
           "OffloadFileError", "OffloadSpaceError"]
