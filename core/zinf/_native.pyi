"""Type stubs for the zinf C++ extension (cpp/). Tensors cross as data_ptr() addresses."""

from . import _native_adam as adam
from . import _native_aio as aio
from . import _native_pool as pool

__all__ = ["adam", "aio", "pool"]
