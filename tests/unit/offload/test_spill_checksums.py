"""The construction spill (zinf/offload/spill_store.py) checks what it reads back against the CRC32C of what it
wrote: a shard corrupted on the drive is refused, naming the file, instead of trained on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf import native
from zinf.offload import OffloadFileError
from zinf.offload.spill_store import SpillStore
from zinf.param.four_bit import WidenedShard

needs_checksums = pytest.mark.skipif(native.checksum_backend() == "python",
                                     reason="records are checksummed only with the native build")


class _Group:
    """What the spill reads of a group: its name, shard size and storage format."""

    def __init__(self, name: str, numel: int) -> None:
        self.name, self.shard_numel = name, numel
        self.storage_dtype, self.format = torch.float32, WidenedShard(torch.float32)
        self.shard_nbytes, self.device = numel * 4, torch.device("cpu")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@needs_checksums
def test_a_corrupted_spill_record_is_refused(tmp_path: Path) -> None:
    spill = SpillStore(str(tmp_path), rank=0)
    a, b, placeholder = _Group("a", 3000), _Group("b", 1000), _Group("c", 500)
    values = torch.randn(3000)
    spill.add(a, values)
    spill.add(b, torch.randn(1000))
    spill.add(placeholder, None)
    assert torch.equal(spill.read(a), values)
    _flip(spill.path, 5000)  # inside a's record
    with pytest.raises(OffloadFileError, match=rf"{spill.path}.*a's shard.*offset 0.*corrupted"):
        spill.read(a)
    spill.read(b)  # the other records are intact
    assert torch.equal(spill.read(placeholder), torch.zeros(500))  # never written: zeros, nothing to check
    spill.close()


@needs_checksums
def test_a_rewritten_record_is_checked_against_its_new_values(tmp_path: Path) -> None:
    spill = SpillStore(str(tmp_path), rank=0)
    g = _Group("g", 1024)
    spill.add(g, None)
    spill.writer(g).copy_(torch.arange(1024.0))
    spill.commit(g)
    assert torch.equal(spill.read(g), torch.arange(1024.0))
    _flip(spill.path, 8)
    with pytest.raises(OffloadFileError, match="corrupted"):
        spill.take(g)
    spill.close()


@needs_checksums
def test_the_engine_refuses_a_corrupted_spill(tmp_path: Path) -> None:
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "nvme_paths": [str(tmp_path)],
                                                 "pinned_pool_bytes": 4 << 20}})
    with zinf.Init(cfg):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    [spill] = [str(p) for p in tmp_path.iterdir() if p.suffix == ".spill"]
    _flip(spill, 100)
    with pytest.raises(OffloadFileError, match=rf"{os.path.basename(spill)}.*corrupted"):
        zinf.initialize(model, torch.optim.AdamW(model.parameters()), cfg)
