"""A pinned pool whose buddy blocks are fragmented must not stall the offloaded step.

Found by running the main job with a 64 MiB pool: the states read ahead during backward filled most of the pool
in blocks of two sizes; at the step's start the gradient of every sub-group read ahead was requested with a
waiting acquire, the free bytes were there but no block of the size, and the only buffers that could be given
back were the ones this same thread held in its read-ahead. Each rank waited out the acquire timeout (120 s) and
failed the step. Read-ahead now takes only blocks the pool has at once and gives its tail back when it cannot.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import processes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_fragmented_pool_does_not_stall_the_step(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZINF_NVME_DIR": str(nvme)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train_gpt.py"), "model.block=128", "model.n_layer=6", "train.steps=16",
           "zinf.offload.pinned_pool_bytes=67108864", f"train.out_dir={tmp_path / 'run'}"]
    proc = processes.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "PoolExhaustedError" not in proc.stderr
