"""A checkpoint becomes current only when every rank's file is on disk, through one commit record: saves
killed at random moments, files missing or from another save, leftovers, and a full disk."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zinf
from dist_utils import run_distributed
from zinf.checkpoint import CheckpointError, consolidate, read_client_state
from zinf.checkpoint.leftovers import hold_save_lock, release_save_lock
import processes

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
KILL_ITERATIONS = 40


@pytest.mark.slow
def test_saves_killed_at_random_moments_leave_one_whole_save(tmp_path: Path) -> None:
    """Two ranks save in a loop and are SIGKILLed at a random moment, 40 times; each time fresh processes
    load what is current: always one whole save, the newest committed one or the one in flight."""
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = processes.run([sys.executable, str(HERE / "checkpoint_kill_driver.py"), "--work", str(tmp_path),
                           "--iterations", str(KILL_ITERATIONS), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    report = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-3000:], "iterations": []}
    assert proc.returncode == 0 and report["error"] is None, report["error"]
    assert len(report["iterations"]) == KILL_ITERATIONS
    outcomes = collections.Counter(it["outcome"] for it in report["iterations"])
    sys.stdout.write(f"\nkilled saves: {dict(outcomes)} (old: the save in flight was not committed; new: it was)\n")
    assert outcomes["old"] + outcomes["new"] == KILL_ITERATIONS - 1


# -- refusals and leftovers, on 2 ranks --------------------------------------------------------------------

def _engine() -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    return zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _save(engine: zinf.ZeroInfinityEngine, ckpt: Path, step: int, client: dict | None = None) -> None:
    for g in engine.groups:
        engine.set_master(g, torch.full_like(engine.master_of(g), float(step)))
    engine.global_step = step
    engine.save_checkpoint(str(ckpt), client_state=client if client is not None else {"step": step})


def _load(ckpt: Path) -> str | int:
    """The loaded step (checked against the values), or the CheckpointError's message."""
    engine = _engine()
    try:
        client = engine.load_checkpoint(str(ckpt))
    except CheckpointError as exc:
        return str(exc)
    values = {float(v) for g in engine.groups for v in engine.master_of(g).unique()}
    assert values == {float(engine.global_step)} and client == {"step": engine.global_step}
    return engine.global_step


def _current(ckpt: Path) -> list[str]:
    return json.loads((ckpt / "commit.json").read_text())["files"]


LEFTOVERS = ["commit.json.tmp", "step00000009-00000000abcd.rank00000-of-00002.pt",
             "step00000009-00000000abcd.rank00001-of-00002.pt", "rank00001-of-00002.pt.tmp",
             "rank00003-of-00004.pt"]
FOREIGN = ["notes.txt", "rank7.pt", "model.safetensors"]
IN_FLIGHT = ["step00000009-00000000abcd.rank00000-of-00002.pt", "step00000009-00000000abcd.rank00001-of-00002.pt"]
OLDER = ["step00000001-00000000dcba.rank00000-of-00002.pt", "step00000001-00000000dcba.rank00001-of-00002.pt"]


def _refusals(rank: int, world: int, root: str) -> dict:
    ckpt, aside, out = Path(root) / "ckpt", Path(root) / "aside", {}
    engine = _engine()
    _save(engine, ckpt, 1)
    if rank == 0:
        aside.mkdir()
        shutil.copy(ckpt / _current(ckpt)[1], aside / "step1-rank1.pt")
    _save(engine, ckpt, 2)
    step2 = out["step2"] = _current(ckpt)
    if rank == 0:
        shutil.copy(ckpt / step2[1], aside / "step2-rank1.pt")
        shutil.copy(aside / "step1-rank1.pt", ckpt / step2[1])  # rank 1's file of save 1 under save 2's name
    dist.barrier()
    out["other_save"] = _load(ckpt)
    if rank == 0:
        (ckpt / step2[1]).unlink()
    dist.barrier()
    out["missing"] = _load(ckpt)
    if rank == 0:
        shutil.copy(aside / "step2-rank1.pt", ckpt / step2[1])
        for name in LEFTOVERS + FOREIGN:
            (ckpt / name).write_bytes(b"leftover")
    dist.barrier()
    out["restored"] = _load(ckpt)
    dist.barrier()
    out["after_load"] = sorted(os.listdir(ckpt))
    dist.barrier()
    if rank == 0:
        for name in LEFTOVERS:
            (ckpt / name).write_bytes(b"leftover")
    _save(engine, ckpt, 3)
    dist.barrier()  # each rank removes the previous save's files it owns after the commit
    out["after_save"], out["step3"] = sorted(os.listdir(ckpt)), _current(ckpt)
    dist.barrier()  # every rank has listed before new files appear
    if rank == 0:
        for name in IN_FLIGHT + OLDER:
            (ckpt / name).write_bytes(b"leftover")
    dist.barrier()
    lock = hold_save_lock(ckpt)  # stands for another job's save in flight
    out["in_flight_load"] = _load(ckpt)
    dist.barrier()
    out["in_flight"] = sorted(os.listdir(ckpt))
    release_save_lock(lock)
    dist.barrier()  # every rank has listed (and released) before the next load removes anything
    _load(ckpt)  # no save in flight: every leftover goes
    dist.barrier()
    for name in IN_FLIGHT:
        assert not (ckpt / name).exists()

    legacy = Path(root) / "legacy"  # the layout of zinf before commits: rank files only
    if rank == 0:
        legacy.mkdir()
        for r, name in enumerate(out["step3"]):
            shutil.copy(ckpt / name, legacy / f"rank{r:05d}-of-00002.pt")
    dist.barrier()
    out["legacy"] = _load(legacy)
    _save(engine, legacy, 4)
    dist.barrier()
    out["legacy_after_save"], out["legacy_loaded"] = sorted(os.listdir(legacy)), _load(legacy)
    return out


def test_mixed_missing_and_leftover_files(tmp_path: Path) -> None:
    results = run_distributed(_refusals, 2, str(tmp_path))
    ckpt = tmp_path / "ckpt"
    for rank, r in enumerate(results):  # every rank raises the same error: none goes on alone
        other, missing = r["other_save"], r["missing"]
        assert "rank 1's file" in other and "belongs to save step00000001-" in other and "at step 1" in other, other
        assert "commit.json names save step00000002-" in other and "at step 2" in other, other
        assert "step00000002-" in missing and ".rank00001-of-00002.safetensors does not exist" in missing, missing
        assert r["restored"] == 2, f"rank {rank}: {r['restored']}"
        assert r["after_load"] == sorted(["commit.json", "commit.lock", *r["step2"], *FOREIGN]), r["after_load"]
        assert r["after_save"] == sorted(["commit.json", "commit.lock", *r["step3"], *FOREIGN]), r["after_save"]
        # a load while another process saves there leaves that save's (newer) parts alone, older ones go
        assert r["in_flight_load"] == 3, r["in_flight_load"]
        assert r["in_flight"] == sorted(["commit.json", "commit.lock", *r["step3"], *FOREIGN, *IN_FLIGHT]), r["in_flight"]
        assert "written by an earlier zinf" in r["legacy"] and "zinf consolidate" in r["legacy"], r["legacy"]
        assert r["legacy_loaded"] == 4
        assert len(r["legacy_after_save"]) == 4 and not any(n.startswith("rank") for n in r["legacy_after_save"])

    # the offline readers follow commit.json with the same checks
    assert read_client_state(ckpt) == {"step": 3}
    assert {float(v) for t in consolidate(ckpt).values() for v in t.unique()} == {3.0}
    part1 = ckpt / results[0]["step3"][1]
    kept = part1.read_bytes()
    shutil.copy(tmp_path / "aside" / "step2-rank1.pt", part1)
    with pytest.raises(CheckpointError, match=r"rank 1's file .* belongs to save step00000002-\S+ at step 2"):
        consolidate(ckpt)
    part1.unlink()
    with pytest.raises(CheckpointError, match=f"{part1.name} does not exist"):
        consolidate(ckpt)
    part1.write_bytes(kept)
    (ckpt / "commit.json").unlink()
    with pytest.raises(CheckpointError, match="no save into it completed"):
        read_client_state(ckpt)


# -- a full disk ----------------------------------------------------------------------------------------------

@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def _fill(mnt: Path, leave_bytes: int) -> None:
    """Grow ``mnt/filler`` until exactly ``leave_bytes`` (a multiple of the page size) are free."""
    filler = mnt / "filler"
    stat = os.statvfs(mnt)
    size = (filler.stat().st_size if filler.exists() else 0) + stat.f_bavail * stat.f_frsize - leave_bytes
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * size)
    stat = os.statvfs(mnt)
    assert stat.f_bavail * stat.f_frsize == leave_bytes


def _full_disk(rank: int, world: int, mnt: str) -> dict:
    mnt = Path(mnt)
    ckpt, out, page = mnt / "ckpt", {}, os.statvfs(mnt).f_frsize
    engine = _engine()
    _save(engine, ckpt, 1)
    parts_bytes = sum(-(-(ckpt / n).stat().st_size // page) * page for n in _current(ckpt))
    dist.barrier()
    for case, leave, client in [
        # rank 1's part (a large client state) cannot fit at all; rank 0's may, and must not commit alone
        ("parts", 16 * page, {"step": 2, "blob": torch.zeros(64 * 1024)} if rank == 1 else None),
        ("commit", parts_bytes, None),  # both parts fit exactly; commit.json does not
    ]:
        if rank == 0:
            _fill(mnt, leave)
        dist.barrier()
        try:
            _save(engine, ckpt, 2, client)
            out[case] = "saved"
        except CheckpointError as exc:
            out[case] = str(exc)
        dist.barrier()
        out[f"{case}_files"] = sorted(os.listdir(ckpt))
        dist.barrier()
    if rank == 0:
        (mnt / "filler").unlink()
    dist.barrier()
    out["loaded"] = _load(ckpt)
    _save(engine, ckpt, 3)
    out["after"] = _load(ckpt)
    return out


def test_full_disk_fails_on_every_rank_and_keeps_the_previous_checkpoint(small_fs: Path) -> None:
    results = run_distributed(_full_disk, 2, str(small_fs))
    for rank, r in enumerate(results):
        for case in ("parts", "commit"):
            msg = r[case]
            assert "no space left on " + str(small_fs) in msg, f"rank {rank}, {case}: {msg}"
            assert "The previous checkpoint (step 1" in msg and "is still current" in msg, msg
            assert "Free space or save elsewhere" in msg, msg
            assert msg == results[0][case], "every rank raises the same error"
            assert len(r[f"{case}_files"]) == 4 and all(n in ("commit.json", "commit.lock") or n.startswith("step00000001-")
                                                        for n in r[f"{case}_files"]), r[f"{case}_files"]
        assert "rank 1: no space left" in r["parts"], r["parts"]
        assert "rank 0: no space left" in r["commit"] and "commit.json" in r["commit"], r["commit"]
        assert r["loaded"] == 1 and r["after"] == 3
