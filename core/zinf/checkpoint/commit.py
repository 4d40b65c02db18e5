"""The commit protocol of a sharded checkpoint: every rank writes its part aside, all ranks agree that every
part is on disk, then one record written by rank 0 makes the new save the current one.

Layout of a checkpoint directory::

    commit.json                                        names the current save (replaced atomically)
    step00000016-3fa9c1d2e4b5.rank00000-of-00002.safetensors    rank 0's part of that save
    step00000016-3fa9c1d2e4b5.rank00001-of-00002.safetensors    rank 1's part

[Note: commit protocol]
A save's tag is ``step<global step>-<random save id>``. Its parts carry the tag in their names, so writing
them never touches a file the current commit names, and each part records the commit it belongs to
(tag, save id, step, world, rank). One rank's side of a save goes WRITING -> AGREED -> COMMITTED, or to
ABANDONED:

1. rank 0 reads the current commit and draws the save id; every rank learns both (one all-gather);
2. WRITING: each rank removes its leftovers (see [Note: leftovers] in zinf/checkpoint/leftovers.py), writes its
   part, flushes and fsyncs it and the directory;
3. every rank learns every rank's outcome (one all-gather). AGREED when all succeeded; otherwise every
   rank removes its part and raises the same CheckpointError (ABANDONED: the previous commit is current);
4. rank 0 writes ``commit.json.tmp``, fsyncs it, renames it onto ``commit.json`` and fsyncs the directory:
   the new save is current from the rename on. Every rank learns the outcome (one all-gather; see [Note:
   node-local storage] for directories that are not shared);
5. COMMITTED: each rank removes the files it owns that the new commit does not name (the previous save).

A kill at any instant leaves the previous commit or the new one current, each with all its parts on disk.
Readers trust only ``commit.json``, and check each part's own record of its commit against it. What rank 0
read is shared with every rank, so ranks also agree when each sees a directory of its own node.

[Note: node-local storage]
When nodes do not share the directory (each writes to its own disk under the same path), step 3 finds out:
every rank reports which of the save's parts it sees. Ranks that see the same set share a directory; the
commit record lists every part, and per rank the lowest rank of its directory (``storage``) and its host.
Step 4 then writes ``commit.json`` in every directory: rank 0's first (the save is current from that rename
on), then the first rank of each other directory. A load follows rank 0's record, shared with every rank, and
each rank reads its own part from its own directory: on the same world size (another world size would need
other nodes' files and is refused with the fix). A directory some ranks see only partly is refused at save
time. Rank ``r``'s files are still owned by rank ``r`` ([Note: leftovers] in zinf/checkpoint/leftovers.py), so
each node removes only its own leftovers.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import secrets
import socket
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from zinf.checkpoint.commit_record import COMMIT, COMMIT_FORMAT, LEGACY_NAME, Commit, read_commit
from zinf.checkpoint.leftovers import hold_save_lock, release_save_lock, remove_leftovers, tidy
from zinf.errors import CheckpointError
from zinf.file_io import remove_quietly

if TYPE_CHECKING:
    from zinf.runtime.comm import Comm

__all__ = ["Save", "SaveState"]

log = logging.getLogger("zinf")


class SaveState(enum.Enum):
    """One rank's side of one save (see [Note: commit protocol]). What is on disk in each state:

    WRITING:   this rank's part, maybe partial, under the new tag; ``commit.json`` names the previous save.
    AGREED:    every rank's part, complete and fsynced; ``commit.json`` still names the previous save.
    COMMITTED: ``commit.json`` names this save; the previous save's files are removed.
    ABANDONED: this save's parts are removed; ``commit.json`` names the previous save, or does not exist.
    """

    WRITING = enum.auto()
    AGREED = enum.auto()
    COMMITTED = enum.auto()
    ABANDONED = enum.auto()


class Save:
    """One rank's side of one save into ``directory``. The constructor, ``agree`` and ``commit`` are collective."""

    def __init__(self, directory: Path, comm: "Comm", global_step: int) -> None:
        self.directory, self.comm = directory, comm
        problem, mine = None, {}
        self._lock: int | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock = hold_save_lock(directory)  # a load meanwhile leaves this save's parts alone
            if comm.rank == 0:
                mine = {"save_id": f"{secrets.randbits(48):012x}", **_previous(directory)}
        except OSError as exc:
            problem = f"cannot use {directory} as a checkpoint directory ({exc})"
        shared = comm.all_gather_object((problem, mine))
        first = shared[0][1]
        self.previous: Commit | None = first.get("commit")
        self.previous_note: str = first.get("note", "")
        self._clean: bool = first.get("clean", False)
        self.new = Commit(tag=f"step{global_step:08d}-{first.get('save_id', '')}", save_id=first.get("save_id", ""),
                          global_step=global_step, world=comm.world)
        self.part = directory / self.new.file(comm.rank)
        self.error: BaseException | None = None
        self.problem: tuple[str, bool] | None = None  # (what went wrong, was it a full disk)
        self.state = SaveState.WRITING
        problems = [(r, (p, False)) for r, (p, _) in enumerate(shared) if p is not None]
        if problems:
            self.state = SaveState.ABANDONED
            release_save_lock(self._lock)
            raise CheckpointError(self._failure(problems))

    def write(self, write_part: Callable[[Path, dict[str, Any]], None]) -> None:
        """Write this rank's part aside and make it durable (``write_part(file, commit record)`` creates ``file``,
        which must not exist, and fsyncs it); a failure is kept for ``agree``, not raised."""
        assert self.state is SaveState.WRITING, self.state
        try:
            if self._clean:
                remove_leftovers(self.directory, self.previous, self.comm.rank, self.comm.world, keep_legacy=True)
            write_part(self.part, self.new.part_record(self.comm.rank))
            _fsync_dir(self.directory)
        except Exception as exc:  # noqa: BLE001 - every rank raises it together in agree()
            remove_quietly(self.part)
            self.error, self.problem = exc, _describe(exc, self.part)

    def agree(self) -> None:
        """WRITING -> AGREED when every rank's part is on disk; else every rank raises (ABANDONED). Also learns
        which ranks see which parts (see [Note: node-local storage])."""
        assert self.state is SaveState.WRITING, self.state
        problems = [(r, p) for r, p in enumerate(self.comm.all_gather_object(self.problem)) if p is not None]
        if problems:
            self._abandon()
            raise CheckpointError(self._failure(problems)) from self.error
        # every part is on disk now: which can each rank see?
        seen = [r for r in range(self.comm.world) if (self.directory / self.new.file(r)).exists()]
        shared = self.comm.all_gather_object((seen, socket.gethostname()))
        views = [tuple(v) for v, _ in shared]
        if any(len(v) != self.comm.world for v in views):  # not one directory for all: each node's own storage
            storage = tuple(min(r for r, w in enumerate(views) if w == v) for v in views)
            self.new = replace(self.new, storage=storage, hosts=tuple(h for _, h in shared))
            odd = [r for r, v in enumerate(views) if r not in v or any(views[k] != v for k in v)]
            if odd:  # a directory that some ranks see only partly: neither shared nor node-local
                self._abandon()
                raise CheckpointError(
                    f"zinf checkpoint: saving to {self.directory} failed and was not committed: ranks {odd} see other "
                    "ranks' parts only partly (a directory shared by some ranks of a node and not others, or files "
                    f"still arriving). {self.previous_note}. Save to one directory every rank shares, or to a "
                    "directory on each node's own disk.")
        self.state = SaveState.AGREED

    def commit(self) -> None:
        """AGREED -> COMMITTED: rank 0 makes this save current, then the first rank of every other node-local
        directory, then every rank removes the previous save's files it owns."""
        assert self.state is SaveState.AGREED, self.state
        leaders = sorted(set(self.new.storage)) if not self.new.shared else [0]
        for leader in leaders:  # rank 0's record first: from its rename on, the save is current
            if self.comm.rank == leader:
                try:
                    _write_commit(self.directory, self.new)
                except Exception as exc:  # noqa: BLE001 - every rank raises it together below
                    self.error, self.problem = exc, _describe(exc, self.directory / COMMIT)
            problems = [(r, p) for r, p in enumerate(self.comm.all_gather_object(self.problem)) if p is not None]
            if problems and leader == 0:
                self._abandon()
                raise CheckpointError(self._failure(problems)) from self.error
            if problems:  # rank 0's record names this save already: its parts must stay
                self.state = SaveState.COMMITTED
                release_save_lock(self._lock)
                raise CheckpointError(
                    f"zinf checkpoint: step {self.new.global_step} was committed on rank 0's storage, but writing "
                    f"{COMMIT} on rank {leader}'s node-local storage failed ({problems[0][1][0]}). The save's files are "
                    "all kept and a load follows rank 0's record; free space there and save again.") from self.error
        self.state = SaveState.COMMITTED
        tidy(self.directory, self.new, self.comm.rank, self.comm.world)
        release_save_lock(self._lock)

    def _abandon(self) -> None:
        self.state = SaveState.ABANDONED
        try:
            self.part.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("zinf checkpoint: could not remove %s of the failed save (%s); the next save or load retries.",
                        self.part, exc)
        finally:
            release_save_lock(self._lock)

    def _failure(self, problems: list[tuple[int, tuple[str, bool]]]) -> str:
        lines = "; ".join(f"rank {r}: {text}" for r, (text, _) in problems)
        advice = " Free space or save elsewhere." if any(full for _, (_, full) in problems) else ""
        return (f"zinf checkpoint: saving step {self.new.global_step} to {self.directory} failed and was not "
                f"committed ({lines}). {self.previous_note}.{advice}")


def _previous(directory: Path) -> dict[str, Any]:
    """What is current before a save (rank 0): the commit, a note for error messages, and whether leftovers
    may be removed (not while ``commit.json`` is unreadable: its files could be the ones it names)."""
    try:
        commit = read_commit(directory)
    except CheckpointError as exc:
        log.warning("%s A successful save replaces it.", exc)
        return {"commit": None, "clean": False, "note": f"{directory / COMMIT} was unreadable and is unchanged"}
    if commit is not None:
        return {"commit": commit, "clean": True,
                "note": f"The previous checkpoint (step {commit.global_step}, save {commit.tag}) is still current"}
    if any((m := LEGACY_NAME.match(n)) and not m["tmp"] for n in os.listdir(directory)):
        return {"commit": None, "clean": True, "note": "The rank files an earlier zinf wrote there are untouched"}
    return {"commit": None, "clean": True, "note": f"No checkpoint was current in {directory} before, and none is now"}


def _write_commit(directory: Path, commit: Commit) -> None:
    """Atomically make ``commit`` current: temporary file, fsync, rename, fsync of the directory."""
    final, tmp = directory / COMMIT, directory / f"{COMMIT}.tmp"
    record = {"format": COMMIT_FORMAT, **asdict(commit), "files": commit.files()}
    if commit.shared:
        del record["storage"], record["hosts"]
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename happened: this save is current now, whatever follows
        _fsync_dir(directory)
    except OSError as exc:
        log.warning("zinf checkpoint: committed %s but could not fsync %s (%s).", commit.tag, directory, exc)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: BaseException, file: Path) -> tuple[str, bool]:
    """What went wrong writing ``file``, and whether it was a full disk (torch.save hides the ENOSPC it hit
    under a RuntimeError "unexpected pos"; the OSError is in the exception's context)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"no space left on {_mount_point(file.parent)} while writing {file}", True
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc} while writing {file}", False


def _mount_point(path: Path) -> Path:
    """The mount point of the file system holding ``path`` (``path`` itself when that cannot be told)."""
    try:
        path = path.resolve()
        device = path.stat().st_dev
        while path.parent != path and path.parent.stat().st_dev == device:
            path = path.parent
    except OSError:
        pass
    return path
