"""Checkpoints crafted to run code if a reader unpickled them: every part of a real save rewritten with valid
checksums (through zinf's own part writer), its record or client state replaced by a pickle of ``RunsCode``, whose
unpickling creates a marker file. A test then checks that reading the checkpoint leaves no marker.

    client   the current format; the client state a torch file holding ``RunsCode``
    record   the current format; the record (zinf.meta) a pickle holding ``RunsCode`` instead of JSON
    earlier  the earlier format (zinf-sharded-v2): record and client state pickles holding ``RunsCode``
    earlier-benign  the earlier format with the part's own record and client state (``client_state`` if given)
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from zinf.checkpoint.client_state import dump_client_state
from zinf.checkpoint.part_file import CLIENT_STATE, META, PICKLED_FORMAT, PartReader, PartWriter, bytes_tensor, payload
from zinf.checkpoint.sharded import FORMAT

HOWS = ("client", "record", "earlier")


class RunsCode:
    """Unpickling it opens (creates) ``marker`` for writing: the code a malicious checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return open, (self.marker, "w")


def craft(checkpoint: str | os.PathLike, how: str, marker: Path, client_state: Any = None) -> list[Path]:
    """Rewrite every part of ``checkpoint``'s current save as ``how`` says; returns the parts."""
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    assert files, f"no parts in {checkpoint}"
    for file in files:
        with PartReader(file, FORMAT, allow_pickle=True) as part:
            meta, names = part.meta, part.names()
            tensors = {n: part.read(n).clone() for n in names}
            own_client = part.client_state(allow_pickle=True)
        evil = RunsCode(marker)
        fmt = FORMAT
        if how == "client":
            extra = payload(meta, {**own_client, "payload": evil})  # the part's own keys kept beside it
        elif how == "record":
            extra = {META: bytes_tensor(pickle.dumps({**meta, "payload": evil})),
                     CLIENT_STATE: bytes_tensor(dump_client_state(own_client))}
        elif how == "earlier":
            fmt = PICKLED_FORMAT
            extra = {META: bytes_tensor(pickle.dumps({**meta, "payload": evil})),
                     CLIENT_STATE: bytes_tensor(pickle.dumps({"payload": evil}))}
        elif how == "earlier-benign":
            fmt = PICKLED_FORMAT
            extra = {META: bytes_tensor(pickle.dumps(meta)),
                     CLIENT_STATE: bytes_tensor(pickle.dumps(own_client if client_state is None else client_state))}
        else:
            raise ValueError(how)
        tmp = file.with_name(file.name + ".crafted")
        writer = PartWriter(tmp, [part.spec(n) for n in names], extra, fmt)
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.finish()
        os.replace(tmp, file)
    assert not marker.exists(), "crafting must not run the payload"
    return files
