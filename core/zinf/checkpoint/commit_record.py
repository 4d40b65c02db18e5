"""What a checkpoint's ``commit.json`` holds (:class:`Commit`), reading it, and checking each part against it.

``commit.json`` names the current save; each part of a save records the commit it belongs to, and a reader trusts
only ``commit.json`` and refuses a part whose own record differs (see [Note: commit protocol] in
zinf/checkpoint/commit.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zinf.errors import CheckpointError

if TYPE_CHECKING:
    from zinf.runtime.comm import Comm

__all__ = ["Commit", "COMMIT", "COMMIT_FORMAT", "PART_NAME", "LEGACY_NAME", "read_commit", "require_commit",
           "agreed_commit", "check_part", "raise_if_any"]

COMMIT = "commit.json"
COMMIT_FORMAT = "zinf-commit-v2"
# a part of a save (``.tmp`` while written), and a rank file of the earlier format that had no commit
PART_NAME = re.compile(r"^step(?P<step>\d+)-[0-9a-f]+\.rank(?P<rank>\d{5})-of-\d{5}\.(pt|safetensors)(\.tmp)?$")
LEGACY_NAME = re.compile(r"^rank(?P<rank>\d{5})-of-\d{5}\.pt(?P<tmp>\.tmp)?$")


@dataclass(frozen=True)
class Commit:
    """One save: what ``commit.json`` holds, and what each of the save's parts records about itself."""

    tag: str
    save_id: str
    global_step: int
    world: int
    # see [Note: node-local storage] in zinf/checkpoint/commit.py: per rank, the lowest rank that sees the same
    # directory (empty: one directory all ranks share), and the host each rank ran on
    storage: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()

    @property
    def shared(self) -> bool:
        return not any(self.storage)

    def file(self, rank: int) -> str:
        return f"{self.tag}.rank{rank:05d}-of-{self.world:05d}.safetensors"

    def files(self) -> list[str]:
        return [self.file(r) for r in range(self.world)]

    def where(self, rank: int) -> str:
        """Where rank ``rank``'s part is, for error messages (empty on shared storage)."""
        if self.shared or rank >= len(self.storage):
            return ""
        return f" (on the storage of rank {self.storage[rank]}, host {self.hosts[rank] if self.hosts else '?'})"

    def part_record(self, rank: int) -> dict[str, Any]:
        """What rank ``rank``'s part stores under its record's ``"commit"`` key (fixed before the save knows where
        its parts landed)."""
        return {"tag": self.tag, "save_id": self.save_id, "global_step": self.global_step, "world": self.world,
                "rank": rank}

    def describe(self) -> str:
        return f"save {self.tag} at step {self.global_step} by {self.world} rank(s)"


def read_commit(directory: Path) -> Commit | None:
    """The commit ``directory/commit.json`` names; ``None`` when there is none."""
    path = directory / COMMIT
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"zinf checkpoint: cannot read {path} ({exc}).") from exc
    try:
        record = json.loads(text)
        if record.get("format") == "zinf-commit-v1":
            raise CheckpointError(
                f"zinf checkpoint: {directory} was written by an earlier zinf (format zinf-sharded-v1, torch files per "
                "rank). Load it with that zinf and save it again with this one, or consolidate it there ('zinf "
                "consolidate') and load the weights with engine.load_full_state_dict.")
        if record.get("format") != COMMIT_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {COMMIT_FORMAT!r}")
        return Commit(tag=str(record["tag"]), save_id=str(record["save_id"]),
                      global_step=int(record["global_step"]), world=int(record["world"]),
                      storage=tuple(int(r) for r in record.get("storage", ())),
                      hosts=tuple(str(h) for h in record.get("hosts", ())))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"zinf checkpoint: {path} is not a zinf commit record ({exc}); it was edited or "
                              "damaged. Restore it from a copy of the checkpoint, or load another checkpoint.") from exc


def require_commit(directory: Path) -> Commit:
    """The current commit of ``directory``, or a CheckpointError saying why there is none."""
    if not directory.exists():
        raise CheckpointError(f"zinf checkpoint: {directory} does not exist.")
    if not directory.is_dir():
        raise CheckpointError(f"zinf checkpoint: {directory} is not a directory (a zinf checkpoint is a directory "
                              f"holding {COMMIT} and one file per rank).")
    commit = read_commit(directory)
    if commit is not None:
        return commit
    names = sorted(os.listdir(directory))
    if any((m := LEGACY_NAME.match(n)) and not m["tmp"] for n in names):
        raise CheckpointError(
            f"zinf checkpoint: {directory} holds rank files but no {COMMIT}: it was written by an earlier zinf, "
            "whose saves had no commit, so nothing proves that its rank files come from one save. Load it with "
            "the zinf that wrote it and save it again with this one (or consolidate it there with 'zinf consolidate' "
            "and load the weights with engine.load_full_state_dict).")
    if any(PART_NAME.match(n) for n in names):
        raise CheckpointError(f"zinf checkpoint: {directory} has no {COMMIT}: no save into it completed (it holds "
                              "parts of an interrupted save, which are never loaded). Load another checkpoint.")
    raise CheckpointError(f"zinf checkpoint: {directory} holds no zinf checkpoint (no {COMMIT}).")


def agreed_commit(directory: Path, comm: "Comm") -> Commit:
    """The commit rank 0 reads, on every rank; every rank raises the same error when there is none (collective)."""
    found: Commit | str | None = None
    if comm.rank == 0:
        try:
            found = require_commit(directory)
        except (CheckpointError, OSError) as exc:  # every rank must hear of it, or the others wait forever
            found = str(exc) if isinstance(exc, CheckpointError) else f"zinf checkpoint: cannot read {directory} ({exc})."
    found = comm.all_gather_object(found)[0]
    if isinstance(found, str):
        raise CheckpointError(found)
    return found


def check_part(record: Any, commit: Commit, rank: int, file: Path) -> None:
    """Refuse a part whose own record (its payload's ``"commit"``) is not rank ``rank`` of ``commit``."""
    if record == commit.part_record(rank):
        return
    if isinstance(record, dict):
        found = (f"save {record.get('tag')} at step {record.get('global_step')} "
                 f"(rank {record.get('rank')} of {record.get('world')})")
    else:
        found = "no save (it has no commit record; written by an earlier zinf?)"
    raise CheckpointError(
        f"zinf checkpoint: rank {rank}'s file {file} belongs to {found}, but {COMMIT} names {commit.describe()} "
        f"(rank {rank} of {commit.world}): the directory mixes files of different saves. Restore the files of "
        "one save, or load another checkpoint.")


def raise_if_any(comm: "Comm", problem: str | None, cause: BaseException | None = None) -> None:
    """Every rank raises when any rank had a problem, so none goes on alone into a collective (collective)."""
    problems = [(r, p) for r, p in enumerate(comm.all_gather_object(problem)) if p is not None]
    if len(problems) == 1:
        raise CheckpointError(problems[0][1]) from cause
    if problems:
        raise CheckpointError("; ".join(f"rank {r}: {p}" for r, p in problems)) from cause
