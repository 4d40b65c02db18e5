"""Convert a checkpoint of the earlier, pickled part format to the current one, once (``zinf upgrade-checkpoint``).

Each part of the current save is read with its pickles (the user who runs the command trusts the files) and
written again beside it under a temporary name, the record as JSON and the client state as a torch file (see
[Note: part file] in zinf/checkpoint/part_file.py), then renamed over the old part: the commit record and the
parts' names do not change, so a run killed part way leaves every part whole, either format, and running the
command again converts the rest. One tensor is in memory at a time. Parts already current are left alone; on
node-local storage each node converts the parts in its own directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from zinf.checkpoint.commit_record import require_commit
from zinf.checkpoint.leftovers import save_in_flight
from zinf.checkpoint.part_file import PartReader, PartWriter, payload
from zinf.checkpoint.sharded import FORMAT
from zinf.errors import CheckpointError

__all__ = ["upgrade_checkpoint", "Upgraded"]

log = logging.getLogger("zinf")


@dataclass(frozen=True)
class Upgraded:
    """What :func:`upgrade_checkpoint` did: the parts converted, those already current, those not in the
    directory (another node's, on node-local storage)."""

    converted: list[Path]
    current: list[Path]
    absent: list[Path]


def upgrade_checkpoint(path: str | os.PathLike) -> Upgraded:
    """Convert every part of the current save in ``path`` that is of the earlier, pickled format (reading its
    pickles: run it only on a checkpoint you trust); no process group needed."""
    directory = Path(path)
    commit = require_commit(directory)
    if save_in_flight(directory):
        raise CheckpointError(f"zinf upgrade-checkpoint: a save into {directory} is in progress (its commit.lock is "
                              "held). Run the command when no run is saving into the directory.")
    converted, current, absent = [], [], []
    for rank in range(commit.world):
        file = directory / commit.file(rank)
        if not file.exists():
            absent.append(file)
            continue
        with PartReader(file, FORMAT, allow_pickle=True) as old:
            if not old.pickled:
                current.append(file)
                continue
            _rewrite(old, file.with_name(file.name + ".tmp"))
        os.replace(file.with_name(file.name + ".tmp"), file)
        converted.append(file)
        log.info("zinf upgrade-checkpoint: converted %s", file)
    if not converted and not current:
        raise CheckpointError(f"zinf upgrade-checkpoint: none of the {commit.world} part(s) that {directory / 'commit.json'} "
                              "names is in the directory. Run it where the parts are.")
    return Upgraded(converted, current, absent)


def _rewrite(old: PartReader, tmp: Path) -> None:
    tmp.unlink(missing_ok=True)  # left by a killed run
    names = old.names()
    writer = PartWriter(tmp, [old.spec(n) for n in names], payload(old.meta, old.client_state(allow_pickle=True)),
                        FORMAT)
    try:
        for name in names:
            writer.write(name, old.read(name))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
