"""The step report's ``nvme_floor``: the NVMe bytes a step moved, at the speed ``zinf info --nvme`` measured
(zinf/offload/disk_speed.py); none without a measurement."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.inspect_cli import info
from zinf.offload.disk_speed import SPEED_FILE, load_speed, save_speed


def _steps(nvme: Path) -> zinf.StepReport:
    """The report of a second step whose NVMe traffic all falls inside it: with the optimizer step in the background,
    a step's sweep may finish before its report or start after it, so the bytes a report counts depend on timing."""
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [str(nvme)],
                                                    "pinned_pool_bytes": 4 << 20, "overlap_optimizer": False}})
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for _ in range(2):
        engine.backward(model(torch.randn(8, 64)).square().mean())
        engine.step()
    report = engine.report()
    engine.close()
    assert report is not None
    return report


def test_the_floor_is_the_bytes_at_the_measured_speed(tmp_path: Path) -> None:
    assert "nvme_floor" not in _steps(tmp_path).seconds  # never measured
    save_speed(str(tmp_path), write_gbs=0.5, read_gbs=2.0, direct=True)
    report = _steps(tmp_path)
    read, written = report.counts["nvme_read_bytes"], report.counts["nvme_written_bytes"]
    assert read > 0 and written > 0
    assert report.seconds["nvme_floor"] == pytest.approx(read / 2e9 + written / 0.5e9)  # no mixed speed: in turn
    assert "nvme_floor" in report.summary()
    for mixed in (1.0, 4.0):  # reads and writes at once, slower or faster together than apart
        save_speed(str(tmp_path), write_gbs=0.5, read_gbs=2.0, direct=True, mixed_gbs=mixed)
        report = _steps(tmp_path)
        read, written = report.counts["nvme_read_bytes"], report.counts["nvme_written_bytes"]
        expected = max(read / 2e9, written / 0.5e9, (read + written) / (mixed * 1e9))
        assert report.seconds["nvme_floor"] == pytest.approx(expected)


def test_zinf_info_keeps_what_it_measured(tmp_path: Path) -> None:
    if info(io.StringIO(), [str(tmp_path)], 8 << 20) != 0:
        pytest.skip("the directory could not be measured here")
    speed = load_speed([str(tmp_path)])
    assert (tmp_path / SPEED_FILE).exists()
    assert speed is None or min(speed.read_bytes_per_s, speed.write_bytes_per_s, speed.mixed_bytes_per_s) > 0  # None: no O_DIRECT


def test_a_capped_measurement_is_kept_apart(tmp_path: Path) -> None:
    save_speed(str(tmp_path), write_gbs=0.5, read_gbs=2.0, direct=True, mixed_gbs=1.0)
    save_speed(str(tmp_path), write_gbs=0.002, read_gbs=0.002, direct=True, mixed_gbs=0.002, bytes_per_s=2_000_000)
    uncapped, capped = load_speed([str(tmp_path)]), load_speed([str(tmp_path)], 2_000_000)
    assert uncapped is not None and uncapped.read_bytes_per_s == 2e9  # not replaced by the capped one
    assert capped is not None and capped.read_bytes_per_s == 2e6
    assert load_speed([str(tmp_path)], 1_000_000) is None  # never measured under that cap


def test_a_file_of_the_older_form_is_the_uncapped_speed(tmp_path: Path) -> None:
    (tmp_path / SPEED_FILE).write_text('{"write_gbs": 0.5, "read_gbs": 2.0, "mixed_gbs": 1.0, "direct": true}')
    speed = load_speed([str(tmp_path)])
    assert speed is not None and speed.write_bytes_per_s == 0.5e9
    assert load_speed([str(tmp_path)], 2_000_000) is None


def test_measuring_a_read_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    from zinf.offload.disk_speed import measure_read

    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(256)) * 4_700)  # 1.15 MiB: a read of a size that is no power of two
    before = (f.read_bytes(), f.stat().st_mtime_ns)
    bw = measure_read(f)
    assert bw is None or bw > 0  # None where the file system refuses O_DIRECT (tmpfs)
    assert (f.read_bytes(), f.stat().st_mtime_ns) == before


def test_a_measurement_of_a_size_that_is_no_power_of_two(tmp_path: Path) -> None:
    from zinf.offload.disk_speed import measure_path

    write, read, mixed, _ = measure_path(str(tmp_path), 3 << 20)  # the pinned pool's blocks are powers of two
    assert min(write, read, mixed) > 0 and not list(tmp_path.iterdir())
