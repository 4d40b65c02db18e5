"""[Note: one copy on the drive] in zinf/placement.py: a model built straight to NVMe under ``zinf.Init`` on a drive
with room for its shards once, not twice, is placed and trains, with the same losses as in memory. The drive is a
small ext4 file system mounted from a loop device (root only; skipped where it cannot be mounted)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import zinf

LAYERS, WIDTH = 8, 2048  # 33.6M parameters, 134 MB of fp32 shards on one rank


@pytest.fixture
def small_drive(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to mount a small file system")
    image, mount = tmp_path / "drive.img", tmp_path / "drive"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(240 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(image)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a loop device here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)  # lazily: a failed run may still hold a file


def _losses(config: zinf.ZeroConfig, steps: int = 2) -> list[float]:
    torch.manual_seed(0)
    with zinf.Init(config):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine = zinf.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        loss = engine(torch.randn(4, WIDTH, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    engine.close()
    return out


def test_a_model_that_fits_the_drive_once_is_placed_and_trains(small_drive: Path) -> None:
    shards = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    free = shutil.disk_usage(small_drive).free
    assert shards < free < 2 * shards, (shards, free)  # room for the shards once, not for a spill and a swap copy
    config = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "cpu",
                                                    "nvme_paths": [str(small_drive)], "pinned_pool_bytes": 160 << 20}})
    assert _losses(config) == _losses(zinf.ZeroConfig())
    assert not os.listdir(small_drive) or os.listdir(small_drive) == ["lost+found"]  # spill and swap files removed
