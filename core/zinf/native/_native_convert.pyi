"""Stubs for zinf._native.convert (a submodule of zinf._native; wrapped by widen.py beside this file)."""

import enum

class Narrow(enum.Enum):
    BF16 = 0
    FP16 = 1

def widen(src: int, dst: int, n: int, kind: Narrow, threads: int = 1) -> None: ...
def widen_crc(src: int, dst: int, n: int, kind: Narrow, threads: int = 1, crc: int = 0) -> int: ...
def copy_crc(src: int, dst: int, nbytes: int, threads: int = 1, crc: int = 0) -> int: ...
