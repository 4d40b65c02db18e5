"""Frozen groups each rank reads whole from the checkpoint's files, outside every collective.

[Note: frozen groups read whole]
A frozen group read in place (see [Note: frozen shards in place] in zinf/offload/in_place.py) lies in files every rank
on one host can read. All-gathered, each rank reads its own shard into its staging pool and every rank copies every
shard out of the ranks' pools ([Note: gathering from the ranks' pools] in zinf/runtime/shared_pool.py), which ties
the ranks together at every module (a round, then the gather's two meetings). With ``offload.frozen_reads: whole``
each rank reads every rank's shard from the same files instead: its gathers of such a group are reads and a widening
copy (or the 4-bit decode) of its own, with no round and no collective; the ranks meet only where a trained group is
gathered or reduced. The price is the disk bytes: each rank reads the whole base, ``world`` times the bytes of the
gathered path. On a 2-core host with a 3.8 GB/s drive that price is the larger one (docs/pretrained.md: a 13B LoRA
step 56.3 s whole against 53.4 s gathered, a 1.1B 5.45 against 5.08 s; the gathers' waits there are the widening,
not the transport), so it is not the default; it is for hosts where the ranks' transport is the slower path.

Decided once, at the placement, from what every rank sees: every rank's records are exchanged, and a group is read
whole only where every rank runs on this host, every rank holds a record of the group, every file has the same
identity (device, inode, size, modification time) for every rank, and the pool can stage the group whole beside what
never waits for room (``PoolNeeds.that_fit``). The decision is then the same on every rank, as the collectives that
remain require. A group's whole record is every rank's extents end to end (rank ``r``'s at ``r`` times the shard's
bytes), checked against the CRC32C of the ranks' checksums combined. A group given new values (a checkpoint loaded
into the engine) gets a swap record of its own shard and is all-gathered again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Sequence

from zinf import native
from zinf.native.checksum import crc32c_combine
from zinf.offload.in_place import Extent, InPlaceRecord
from zinf.runtime.comm import host_boot

if TYPE_CHECKING:
    from zinf.param.flat_group import FlatParamGroup
    from zinf.runtime.comm import Comm

__all__ = ["whole_records"]


def _message(groups: Sequence["FlatParamGroup"], records: Mapping[int, InPlaceRecord]) -> dict:
    """What this rank tells the others: its host, and per group (by index) its record's extents, checksum and files."""
    out: dict = {"host": host_boot(), "groups": {}}  # ranks on one kernel see one file the same
    for i, g in enumerate(groups):
        rec = records.get(id(g))
        if rec is not None and rec.crc is not None:
            out["groups"][i] = {"nbytes": rec.nbytes, "crc": rec.crc,
                                "extents": [(e.path, e.offset, e.nbytes, e.dest) for e in rec.extents],
                                "files": sorted(rec.identities.items())}
    return out


def whole_records(groups: Sequence["FlatParamGroup"], records: Mapping[int, InPlaceRecord], comm: "Comm"
                  ) -> dict[int, InPlaceRecord]:
    """The whole records of the frozen groups every rank reads whole (by group id); see [Note: frozen groups read
    whole]. Empty with one rank, ranks on several hosts, or no group every rank reads in place alike. A collective:
    every rank calls it, with its own records."""
    if comm.world == 1 or native.checksum_backend() == "python":
        return {}
    told = comm.all_gather_object(_message(groups, records))
    if len({m["host"] for m in told}) != 1:
        return {}
    out = {}
    for i, g in enumerate(groups):
        parts = [m["groups"].get(i) for m in told]
        if any(p is None for p in parts) or any(p["files"] != parts[0]["files"] for p in parts) \
                or any(p["nbytes"] != g.shard_nbytes for p in parts):
            continue
        extents, crc = [], 0
        for r, p in enumerate(parts):
            shift = r * g.shard_nbytes
            extents += [Extent(path, offset, nbytes, dest + shift) for path, offset, nbytes, dest in p["extents"]]
            crc = p["crc"] if r == 0 else crc32c_combine(crc, p["crc"], g.shard_nbytes)
        # the files as the loaders saw them, the same on every rank: a file changed since is refused at its next read
        whole = InPlaceRecord.of(g.name, comm.world * g.shard_nbytes, extents, identities=dict(parts[0]["files"]))
        out[id(g)] = replace(whole, crc=crc, ranks=comm.world)
    return out
