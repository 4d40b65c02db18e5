"""Positioned reads and writes of tensor bytes on a file descriptor, looping until done (a read or write may
return short). Used where a file is read or written a piece at a time outside the async I/O engine: the
construction spill (zinf/offload/spill_store.py) and weight files (zinf/checkpoint/tensor_files.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

__all__ = ["read_at", "remove_quietly", "write_at", "write_bytes_at"]

log = logging.getLogger(__name__)


def read_at(fd: int, out: torch.Tensor, offset: int) -> int:
    """Fill contiguous host tensor ``out`` with the file's bytes from ``offset``; returns how many were read (fewer
    than ``out``'s bytes only where the file ends first)."""
    view = memoryview(out.view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def write_at(fd: int, data: torch.Tensor, offset: int) -> None:
    """Write contiguous host tensor ``data``'s bytes at ``offset``."""
    view = memoryview(data.view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_bytes_at(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset``, all of it (a header: one short ``write`` would leave it cut)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def remove_quietly(path: Path) -> None:
    """Remove a file a failed write leaves behind; where even that fails (a file system turned read-only), say so and
    go on: the write's own error is the one to report, on every rank alike."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("zinf: could not remove %s after a failed write (%s); remove it by hand", path, exc)
