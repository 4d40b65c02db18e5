"""[Note: in place or staged] in zinf/plan/frozen_base.py: the rule, its place in ``zinf plan``'s config and table,
and the errors that name the fix (the checkpoint's read speed: tests/unit/offload/test_disk_speed.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zinf.plan import PlanError, plan
from zinf.plan import frozen_base
from zinf.plan.frozen_base import decide

from test_plan import machine


def test_the_rule() -> None:
    base = 10 * 10**9
    assert decide(base, True, 0, None, None)[0]  # same drive: never copied, even with no speeds known
    in_place, why = decide(base, False, 5 * 10**9, 0.1e9, 3e9)
    assert in_place and "5.0 GB free" in why  # no room for a copy
    assert decide(base, False, 100 * 10**9, None, 3e9)[0]
    assert decide(base, False, 100 * 10**9, 2.8e9, 3e9)[0]  # 0.93 of the swap's speed: as fast
    in_place, why = decide(base, False, 100 * 10**9, 0.5e9, 3e9)
    assert not in_place and "copied to the faster drive" in why


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(ckpt / "model.safetensors"))
    return ckpt


def _plan(ckpt: Path, nvme: Path):
    return plan(params=1e8, layers=4, hidden=512, nvme_paths=[str(nvme)], machine=machine(nvme={str(nvme): 100}),
                checkpoint=str(ckpt))


def test_the_plan_sets_frozen_in_place_on_nvme_placements(tmp_path: Path) -> None:
    ckpt, nvme = _checkpoint(tmp_path), tmp_path / "swap"
    nvme.mkdir()
    p = _plan(ckpt, nvme)
    assert p.frozen_base is not None and p.frozen_base.in_place and "swap's drive" in p.frozen_base.why
    assert p.frozen_base.base_bytes == (ckpt / "model.safetensors").stat().st_size
    by_params = {e.placement.params: p.config(e)["offload"] for e in p.estimates}
    assert by_params["nvme"]["frozen_in_place"] is True and "frozen_in_place" not in by_params["device"]
    assert "frozen base: " in p.table() and p.to_dict()["frozen_base"]["in_place"] is True


def test_a_slower_drive_is_staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint(tmp_path)
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(ckpt).st_dev:
        pytest.skip("needs a second file system for the swap (/dev/shm)")
    nvme = Path("/dev/shm") / f"zinf-plan-test-{os.getpid()}"
    nvme.mkdir()
    try:
        monkeypatch.setattr(frozen_base, "measure_read", lambda path: 0.2e9)  # the swap reads at 1 GB/s
        p = _plan(ckpt, nvme)
    finally:
        nvme.rmdir()
    assert p.frozen_base is not None and not p.frozen_base.in_place
    assert p.frozen_base.checkpoint_read_bw == 0.2e9 and p.frozen_base.swap_read_bw == 1e9
    nvme_row = next(e for e in p.estimates if e.placement.params == "nvme")
    assert p.config(nvme_row)["offload"]["frozen_in_place"] is False


def test_errors_name_the_fix(tmp_path: Path) -> None:
    nvme = tmp_path / "swap"
    nvme.mkdir()
    with pytest.raises(PlanError, match="no \\*.safetensors files"):
        _plan(tmp_path / "nothing", nvme)
    with pytest.raises(PlanError, match="give the swap directory with --nvme"):
        plan(params=1e8, machine=machine(), checkpoint=str(_checkpoint(tmp_path)))
