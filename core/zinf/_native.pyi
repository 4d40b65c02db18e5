"""Type stubs for the zinf C++ extension (cpp/). Tensors cross as data_ptr() addresses.

This stub stays here, beside the built ``zinf/_native*.so`` (a stub must sit where its module is).
The submodules' stubs sit beside the Python modules that wrap them, in ``zinf/native/``
(``_native_adam.pyi`` beside ``adam.py``, ...); they are stub-only names, not importable at run time.
"""

from .native import _native_adam as adam
from .native import _native_aio as aio
from .native import _native_checksum as checksum
from .native import _native_convert as convert
from .native import _native_fault as fault
from .native import _native_four_bit as four_bit
from .native import _native_pool as pool
from .native import _native_shm as shm

source_fingerprint: str  # SHA-256 over the C++ sources it was built from (cpp/CMakeLists.txt)

__all__ = ["adam", "aio", "checksum", "convert", "fault", "four_bit", "pool", "shm", "source_fingerprint"]
