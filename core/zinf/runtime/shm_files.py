"""Files in ``/dev/shm`` that every rank of one host opens: the same-host transport's segments, which every rank maps
(zinf/runtime/same_host.py), and the shared staging pools, each mapped by its own rank and read by the others
(zinf/runtime/shared_pool.py)."""

from __future__ import annotations

import mmap
import os
from typing import Any, Sequence

__all__ = ["SHM_DIR", "map_segments"]

SHM_DIR = "/dev/shm"


def map_segments(all_gather_object: Any, rank: int, sizes: Sequence[int], prefix: str, peers_mapped: bool = True
                 ) -> "list[Any] | str":
    """Every rank calls this together: rank r makes ``/dev/shm/{prefix}-r`` of ``sizes[r]`` bytes, then every rank
    maps every rank's file (or, without ``peers_mapped``, maps its own and opens the others' read-only), then unlinks
    its own (whatever happened: nothing is left behind). Every rank's ``mmap`` (or file descriptor), or (on every
    rank alike) why not."""
    paths = [os.path.join(SHM_DIR, f"{prefix}-{r}") for r in range(len(sizes))]
    error, maps = "", []  # type: tuple[str, list[Any]]
    try:
        try:
            fd = os.open(paths[rank], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, sizes[rank])  # the pages exist now: a full /dev/shm fails here, not as SIGBUS
            finally:
                os.close(fd)
        except OSError as exc:
            error = f"{paths[rank]}: {exc}"
        errors = [e for e in all_gather_object(error) if e]
        try:
            if not errors:
                for r, (path, nbytes) in enumerate(zip(paths, sizes)):
                    if not peers_mapped and r != rank:
                        maps.append(os.open(path, os.O_RDONLY))
                        continue
                    fd = os.open(path, os.O_RDWR)
                    try:
                        maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
                    finally:
                        os.close(fd)
        except OSError as exc:
            errors = [f"{exc}"]
        errors = [e for e in all_gather_object("; ".join(errors)) if e]  # every rank mapped every file, or none
    finally:
        try:
            os.unlink(paths[rank])
        except FileNotFoundError:  # never made (O_EXCL refused it, or the open failed)
            pass
    if errors:
        for m in maps:
            os.close(m) if isinstance(m, int) else m.close()
        return errors[0]
    return maps
