"""Each offload failure a user can hit gets the error that names the setting and the fix; nothing
already written is trained on. One process (world 1), real files."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.errors import CheckpointError
from zinf.offload import OffloadFileError, OffloadSpaceError
import processes


def _engine(tmp: Path | str, **offload) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(tmp)],
                                                 "pinned_pool_bytes": 4 << 20, **offload}})
    with zinf.Init(cfg):
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)


def _step(engine: zinf.ZeroInfinityEngine) -> None:
    loss = engine(torch.randn(8, 64)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.synchronize()  # the offloaded step runs in the background; finish it before touching the files


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(OffloadSpaceError, match=r"offload.nvme_paths entry '.*/nope' does not exist. Create the directory"):
        _engine(tmp_path / "nope")


def test_no_nvme_path_configured() -> None:
    with pytest.raises(zinf.ConfigError, match=r"'offload.nvme_paths' = \[\] is not allowed; expected at least one directory"):
        zinf.ZeroConfig.from_dict({"offload": {"params": "nvme"}})


@pytest.fixture
def tiny_fs(tmp_path: Path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_no_space_fails_before_training(tiny_fs: Path) -> None:
    # units that show the difference (KiB here), never "needs 0.00 GiB ... has 0.00 GiB free"
    with pytest.raises(OffloadSpaceError, match=r"needs \d+\.\d KiB for rank 0's offloaded state but has \d+\.\d KiB free") as err:
        _engine(tiny_fs)
    assert not list(tiny_fs.glob("*.swap")), "a placement that does not fit must not leave swap files behind"
    # what zinf.Init built for NVMe stays in its spill file while the model lives (the traceback holds it here), and
    # goes with the model (see spill_store.py)
    del err
    gc.collect()
    assert not list(tiny_fs.iterdir()), "a dropped model must not leave its spill file behind"


def _swap_file(tmp: Path) -> Path:
    files = list(tmp.glob("*.swap"))
    assert len(files) == 1
    return files[0]


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    _step(engine)
    os.truncate(_swap_file(tmp_path), 8192)
    with pytest.raises(OffloadFileError, match="is truncated"):
        _step(engine)


def test_foreign_record_is_detected(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    _step(engine)
    path = _swap_file(tmp_path)
    with open(path, "r+b") as f:  # another program scribbles over the file
        f.seek(4096)
        f.write(os.urandom(os.path.getsize(path) - 4096))
    with pytest.raises(OffloadFileError, match="is not a zinf record"):
        _step(engine)


def test_stale_file_is_detected(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    _step(engine)
    path = _swap_file(tmp_path)
    snapshot = tmp_path / "old.bin"
    shutil.copyfile(path, snapshot)
    _step(engine)
    shutil.copyfile(snapshot, path)  # the last step's writes are lost (the initial write was generation 1)
    with pytest.raises(OffloadFileError, match=r"is stale \(generation 2, expected 3\)"):
        _step(engine)


def test_file_from_another_run_is_detected(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    a, b = _engine(first), _engine(second)
    _step(a)
    _step(b)
    shutil.copyfile(_swap_file(first), _swap_file(second))  # same layout, other run
    with pytest.raises(OffloadFileError, match="belongs to another run or rank"):
        _step(b)


def test_host_memory_budget_too_small(tmp_path: Path) -> None:
    with pytest.raises(OffloadSpaceError, match=r"needs about .* GiB of host memory per rank, but offload.max_cpu_bytes allows"):
        _engine(tmp_path, optimizer="cpu", params="cpu", max_cpu_bytes=1024)


def test_pinned_pool_too_small(tmp_path: Path) -> None:
    cfg = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "nvme_paths": [str(tmp_path)], "pinned_pool_bytes": 1 << 20}})
    model = nn.Linear(1024, 1024)
    with pytest.raises(OffloadSpaceError, match=r"offload.pinned_pool_bytes = 1048576 is too small"):
        zinf.initialize(model, torch.optim.Adam(model.parameters()), cfg)


def test_offloaded_optimizer_needs_adam(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    cfg = zinf.ZeroConfig.from_dict({"offload": {"optimizer": "cpu"}})
    with pytest.raises(zinf.UnsupportedModelError, match="must be torch.optim.Adam or AdamW .*found SGD"):
        zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def test_failed_background_step_stops_training(tmp_path: Path) -> None:
    engine = _engine(tmp_path, grads="cpu")  # so the file's last record is an optimizer state, not a gradient
    _step(engine)
    engine.synchronize()  # as before touching offload files from outside: nothing of them is held in memory
    path = _swap_file(tmp_path)
    with open(path, "r+b") as f:  # the last record in the file is an optimizer state: break its trailer
        f.seek(os.path.getsize(path) - 64)
        f.write(b"\0" * 64)
    loss = engine(torch.randn(8, 64)).square().mean()
    engine.backward(loss)
    engine.step()  # runs in the background and fails there
    for _ in range(2):  # every later use raises, so nothing trains on a half-updated model
        with pytest.raises(OffloadFileError, match="is not a zinf record"):
            engine(torch.randn(8, 64)).square().mean().backward()


def test_io_error_mid_step_leaves_the_last_checkpoint_intact(tmp_path: Path) -> None:
    """A record that fails its check during the step fails the step, and a later save raises instead of
    replacing the last good checkpoint with a half-updated model; that checkpoint still loads."""
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    engine = _engine(swap, grads="cpu")
    _step(engine)
    engine.save_checkpoint(str(ckpt), {"epoch": 3})
    saved = engine.full_state_dict()
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    engine.synchronize()
    path = _swap_file(swap)
    with open(path, "r+b") as f:  # the I/O error: the file's last record (an optimizer state) no longer checks out
        f.seek(os.path.getsize(path) - 64)
        good = f.read(64)
        f.seek(os.path.getsize(path) - 64)
        f.write(b"\0" * 64)
    loss = engine(torch.randn(8, 64)).square().mean()
    engine.backward(loss)
    engine.step()  # fails in the background
    with pytest.raises(OffloadFileError, match="is not a zinf record"):
        engine.synchronize()
    with open(path, "r+b") as f:  # the file reads cleanly again, but the failed step left the model half updated
        f.seek(os.path.getsize(path) - 64)
        f.write(good)
    with pytest.raises(CheckpointError, match=r"failed and was not committed .*is not a zinf record.*The previous "
                                              r"checkpoint \(step 1, .*\) is still current"):
        engine.save_checkpoint(str(ckpt), {"epoch": 4})
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == files, "the last good checkpoint was touched"
    restored_dir = tmp_path / "restored"
    restored_dir.mkdir()
    restored = _engine(restored_dir, grads="cpu")
    assert restored.load_checkpoint(str(ckpt)) == {"epoch": 3}
    got = restored.full_state_dict()
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    restored.close()


def test_a_crashed_run_does_not_leave_its_swap_files(tmp_path: Path) -> None:
    script = f"""
import torch, zinf
from torch import nn
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
cfg = zinf.ZeroConfig.from_dict({{"offload": {{"params": "nvme", "optimizer": "nvme", "nvme_paths": [{str(tmp_path)!r}],
                                              "pinned_pool_bytes": 4 << 20}}}})
engine = zinf.initialize(model, torch.optim.Adam(model.parameters()), cfg)
assert any(p.name.endswith(".swap") for p in __import__("pathlib").Path({str(tmp_path)!r}).iterdir())
raise RuntimeError("the training script failed")
"""
    proc = processes.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the training script failed" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == []
