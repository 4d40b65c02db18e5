"""Device memory apart from the host's, and the host buffers that stage what crosses between them.

[Note: staged device]
On CUDA the compute device's memory is not the host's: a shard offloaded to the CPU reaches the device through a
copy from a (pinned) host buffer, and a gradient shard leaves it the same way. On CPU the two are one memory, so
that path would never run in CI. The test setting ``ZINF_STAGED_DEVICE=1`` makes a CPU compute device behave as a
device apart: the engine keeps separate device-side tensors, stages through host buffers and copies between them,
the same code as on CUDA (without pinning: the buffers are plain host memory, the streams and events the CPU's
no-ops). The device-side tensors are recorded (:func:`mark_device`), and what only the host may touch (the CPU-Adam,
``zinf/native/adam.py``) refuses them (:func:`is_device_memory`), as a CUDA tensor would be refused: a step that
hands device memory to the host fails its CPU test instead of only failing on a GPU. The setting is read when the
engine is built (set it before), and is meant for tests only.
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import torch

__all__ = ["STAGED_DEVICE_ENV", "device_is_apart", "host_empty", "host_zeros", "is_device_memory", "mark_device"]

STAGED_DEVICE_ENV = "ZINF_STAGED_DEVICE"

# storages of the CPU tensors that stand in for device memory (staged setting only)
_device_storages: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()


def _staged_cpu() -> bool:
    return os.environ.get(STAGED_DEVICE_ENV, "") == "1"


def device_is_apart(device: torch.device) -> bool:
    """Whether ``device``'s memory is apart from the host's: CUDA, or the CPU under ``ZINF_STAGED_DEVICE=1``."""
    return device.type != "cpu" or _staged_cpu()


def mark_device(*tensors: torch.Tensor | None) -> None:
    """Record CPU tensors that hold device memory under the staged setting (no-op otherwise, and on CUDA)."""
    if not _staged_cpu():
        return
    for t in tensors:
        if t is not None and t.device.type == "cpu":
            _device_storages.add(t.untyped_storage())


def is_device_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is device memory: on a device other than the CPU, or marked as such (staged setting)."""
    return t.device.type != "cpu" or (bool(_device_storages) and t.untyped_storage() in _device_storages)


def host_empty(shape: int | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer to stage a copy to or from ``device``: pinned where ``device`` is CUDA (so the copy runs
    without the host), plain host memory otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def host_zeros(shape: int | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = host_empty(shape, dtype, device)
    out.zero_()
    return out
