"""Removing what a checkpoint directory holds besides its current save, and the lock that keeps a load from
removing the parts of a save in flight.

[Note: leftovers]
zinf's files in a checkpoint directory are ``commit.json``, ``commit.json.tmp``, the parts of saves (``.tmp``
included; their names: zinf/checkpoint/commit.py), and the rank files of the earlier format that had no commit
(``rank00000-of-00002.pt``, and ``.pt.tmp`` while written). Each is owned by rank ``(its rank number) % world`` (``commit.json.tmp`` by
rank 0), so no two ranks remove the same file and the files of a larger earlier world are removed too.
Nothing else in the directory is ever touched (``commit.lock`` stays: see below). A save removes every
leftover it owns. A load removes them too, unless another process is saving into the directory right now
(savers hold a shared ``flock`` on ``commit.lock`` for the length of a save; the kernel drops it if they die):
then it removes only parts of saves older than the current commit, since a newer part may belong to the
save in flight. One writer per directory: two jobs saving into the same directory at once are not supported.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from zinf.checkpoint.commit_record import COMMIT, LEGACY_NAME, PART_NAME, Commit

__all__ = ["LOCK", "remove_leftovers", "hold_save_lock", "release_save_lock", "save_in_flight", "tidy"]

log = logging.getLogger("zinf")


def _owner(name: str) -> int | None:
    if name == f"{COMMIT}.tmp":
        return 0
    m = PART_NAME.match(name) or LEGACY_NAME.match(name)
    return int(m["rank"]) if m else None


def remove_leftovers(directory: Path, keep: Commit | None, rank: int, world: int, *, keep_legacy: bool = False,
                     only_older: bool = False) -> None:
    """Remove the files of ``directory`` that ``rank`` owns and ``keep`` does not name (see [Note: leftovers]).
    With ``only_older`` (a load) only parts of saves older than ``keep``: a newer part may belong to a save that
    another process is writing right now, and removing it would break that save's commit."""
    named = set(keep.files()) if keep is not None else set()
    removed = []
    for entry in os.scandir(directory):
        owner = _owner(entry.name)
        if owner is None or owner % world != rank or entry.name in named or not entry.is_file(follow_symlinks=False):
            continue
        if only_older:
            m = PART_NAME.match(entry.name)
            if m is None or keep is None or int(m["step"]) >= keep.global_step:
                continue
        if keep_legacy and (m := LEGACY_NAME.match(entry.name)) and not m["tmp"]:
            continue
        Path(entry.path).unlink(missing_ok=True)
        removed.append(entry.name)
    if removed:
        log.debug("zinf checkpoint: removed %s from %s", ", ".join(sorted(removed)), directory)


LOCK = "commit.lock"


def hold_save_lock(directory: Path) -> int:
    """A saver's shared lock on ``directory/commit.lock`` for the length of its save (the kernel drops it if the
    process dies); returns the fd to close."""
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def release_save_lock(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def save_in_flight(directory: Path) -> bool:
    """Whether some process holds the save lock of ``directory`` (True when that cannot be told)."""
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return True
    try:
        for _ in range(20):  # another reader's probe holds the exclusive lock for an instant: try again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                time.sleep(0.005)
        return True
    finally:
        os.close(fd)


def tidy(directory: Path, keep: Commit, rank: int, world: int, *, loading: bool = False) -> None:
    """``remove_leftovers``; failing to remove (a read-only copy of a checkpoint) is only a warning. At a load
    while another process is saving into the directory, only parts of saves older than ``keep`` go (a newer
    part may belong to the save in flight)."""
    try:
        remove_leftovers(directory, keep, rank, world, only_older=loading and save_in_flight(directory))
    except OSError as exc:
        log.warning("zinf checkpoint: could not remove files of other saves from %s (%s); the next save retries.",
                    directory, exc)
