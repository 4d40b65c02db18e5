import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf import native
from zinf.cli import main
from zinf.inspect_cli import parse_summary
from zinf.report import StepReport


def test_info_and_consolidate(tmp_path: Path, capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"zinf {zinf.__version__}" in out and "native build" in out and "NativeInfo(" not in out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "full.pt"
    result = subprocess.run([sys.executable, "-m", "zinf.cli", "consolidate", str(tmp_path / "ckpt"), str(out)],
                            capture_output=True, text=True, check=True)
    assert "wrote 4 tensors" in result.stdout
    state = torch.load(out)
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


def test_info_prints_readable_lines(capsys) -> None:
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"zinf {zinf.__version__}"
    assert lines[1].startswith(f"torch {torch.__version__}") and lines[2].startswith("Python 3.")
    if native.info().available:
        text = "\n".join(lines)
        for label in ("SIMD level:", "OpenMP threads:", "async I/O backend:", "checksum backend:"):
            assert label in text, label


@pytest.mark.skipif(not native.info().available, reason="needs the native build (AsyncIO)")
def test_info_measures_nvme_paths_and_removes_its_file(tmp_path: Path, capsys) -> None:
    drive = tmp_path / "drive"
    drive.mkdir()
    assert main(["info", "--nvme", str(drive), str(tmp_path / "missing"), "--size-mib", "8"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(f"nvme {drive}:"))
    assert "write " in line and "read " in line and "both at once " in line and line.count("GB/s") == 3
    assert "8 MiB sequential" in line
    assert f"nvme {tmp_path / 'missing'}: not measured" in out and "not a directory" in out
    assert [p.name for p in drive.iterdir()] == ["zinf-disk-speed.json"]  # the test file is gone; the figures kept


def _log_line(report: StepReport) -> str:
    return f"2026-01-01 00:00:00,000 INFO zinf: zinf: {report.summary()}\n"


def test_report_summarises_step_lines(tmp_path: Path, capsys) -> None:
    log = tmp_path / "train.log"
    lines = ["epoch 0 starting\n"]
    for step in range(4):
        seconds = {"compute": 0.010 * (step + 1), "all_gather": 0.002, "reduce_scatter": 0.001, "optimizer": 0.004,
                   "nvme_read": 0.001, "background_nvme_read": 0.003, "optimizer_wait": 0.001, "io_busy": 0.004,
                   "io_stalled": 0.002, "nvme_floor": 0.005, "step_wall": 0.025}
        lines.append(_log_line(StepReport(step=step, seconds=seconds, counts={"nvme_read_bytes": 4096},
                                          bytes={"cpu": {"master": 2**20}, "nvme": {"optimizer_state": 3 * 2**20}},
                                          skipped=step == 2)))
    log.write_text("".join(lines))
    parsed = parse_summary(lines[1])
    assert parsed is not None and parsed.step == 0 and parsed.ms["compute"] == 10.0 and parsed.mib["nvme"] == 3.0
    assert parsed.io_hidden_share == 0.6  # 2 ms stalled of the floor's 5 ms
    assert parsed.disk_utilisation == 0.2  # the floor's 5 ms of the step's 25 ms
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "4 step reports, steps 0 .. 3, 1 skipped" in out
    compute = next(x for x in out.splitlines() if x.startswith("compute"))
    assert compute.split()[1:3] == ["25.0", "25.0"]  # mean and median of 10, 20, 30, 40 ms
    assert "background_nvme_read" in out and "optimizer_wait" in out and "nvme_write" not in out
    assert "resident at step 3: cpu 1.0 MiB, nvme 3.0 MiB" in out
    assert "NVMe I/O hidden share: 60%" in out and "disk busy: 20% of the step" in out


def test_report_of_a_real_run(tmp_path: Path, capsys) -> None:
    log = tmp_path / "run.log"
    handler = logging.FileHandler(log)
    logger = logging.getLogger("zinf")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"log_every_n_steps": 2})
        for _ in range(5):
            engine.backward(engine(torch.randn(4, 8)).sum())
            engine.step()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "3 step reports, steps 0 .. 4" in out and "resident at step 4: cpu" in out
    assert "no NVMe I/O in this run" in out


def test_report_refuses_a_log_without_step_lines(tmp_path: Path, capsys) -> None:
    log = tmp_path / "other.log"
    log.write_text("INFO something else\nloss 1.0\n")
    assert main(["report", str(log)]) == 1
    err = capsys.readouterr().err
    assert "no zinf step lines" in err and "log_every_n_steps" in err
    assert main(["report", str(tmp_path / "absent.log")]) == 2


@pytest.mark.parametrize("size", ["0", "-4"])
def test_info_refuses_a_test_file_under_one_mib_and_keeps_the_saved_speed(tmp_path: Path, capsys, size: str) -> None:
    (tmp_path / "zinf-disk-speed.json").write_text('{"speeds": {}}')
    with pytest.raises(SystemExit) as stop:
        main(["info", "--nvme", str(tmp_path), "--size-mib", size])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert "--size-mib" in captured.err and "at least --size-mib 1" in captured.err and "nvme " not in captured.out
    assert (tmp_path / "zinf-disk-speed.json").read_text() == '{"speeds": {}}'  # the earlier measurement stays
    from zinf.errors import ConfigError
    from zinf.inspect_cli import info

    with pytest.raises(ConfigError, match="--size-mib"):
        info(sys.stdout, [str(tmp_path)], 4096)


def test_report_counts_heap_trim_and_gives_no_share_to_adam_or_the_floor(tmp_path: Path, capsys) -> None:
    """heap_trim is training-thread time the engine takes out of compute; adam may run on the background thread and
    nvme_floor is a bound: neither is a share of the step."""
    seconds = {"compute": 0.010, "all_gather": 0.002, "reduce_scatter": 0.001, "optimizer": 0.003,
               "heap_trim": 0.004, "adam": 0.030, "nvme_floor": 0.050, "step_wall": 0.020}
    log = tmp_path / "trim.log"
    log.write_text("".join(_log_line(StepReport(step=s, seconds=seconds)) for s in range(2)))
    assert main(["report", str(log)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["total"][1:] == ["20.0", "20.0", "100%"]  # 10 + 2 + 1 + 3 + 4 ms
    assert rows["heap_trim"][1:] == ["4.0", "4.0", "20%"] and rows["compute"][3] == "50%"
    assert rows["adam"][1:] == ["30.0", "30.0", "-"] and rows["nvme_floor"][1:] == ["50.0", "50.0", "-"]
