"""Bad input to the main job and to the ``zinf`` command line: one line naming the setting, a non-zero exit code,
no traceback, and nothing written (no output directory, no checkpoint, no NVMe directory)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def _run(tmp_path: Path, *args: str, module: bool = False) -> tuple[int, str]:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    env = {**os.environ, "ZINF_NVME_DIR": str(nvme)}
    env.pop("ZINF_TRACEBACK", None)
    cmd = [sys.executable, "-m", "zinf.cli", *args] if module else [sys.executable, str(EXAMPLE), *args]
    proc = processes.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


BAD_SETTINGS = [
    ("train.steps=0", "'train.steps' = 0"),
    ("train.steps=-3", "'train.steps' = -3"),
    ("train.stpes=5", "Did you mean 'train.steps'?"),
    ("zinf.precison=bf16", "Did you mean 'zinf.precision'?"),
    ("zinf.offload.params=disk", "'offload.params' = 'disk'"),
    ("model.n_head=7", "'model.n_head' = 7"),
    ("train.lr=-1.0", "'train.lr' = -1.0"),
]


@pytest.mark.parametrize("override,names", BAD_SETTINGS)
def test_every_setting_of_the_main_job_is_checked(override: str, names: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from job_config import load_job_config

    import zinf

    with pytest.raises(zinf.ConfigError) as err:
        load_job_config(str(ROOT / "examples" / "configs" / "gpt_small.yaml"), [override])
    assert names in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override,names", [BAD_SETTINGS[0], BAD_SETTINGS[2]])
def test_the_main_job_refuses_bad_settings_before_anything_is_written(tmp_path: Path, override: str, names: str) -> None:
    code, err = _run(tmp_path, override, f"train.out_dir={tmp_path / 'out'}")
    line = _one_line(err)
    assert code == 2 and names in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "zinf_run").exists()
    assert list((tmp_path / "nvme").iterdir()) == []  # no temporary NVMe directory was made


def test_an_output_directory_it_cannot_write_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("keep me")
    code, err = _run(tmp_path, f"train.out_dir={tmp_path / 'a_file' / 'out'}", "train.steps=1")
    line = _one_line(err)
    assert code == 2 and "train.out_dir=" in line and "Pass a writable directory" in line, line
    assert list((tmp_path / "nvme").iterdir()) == []  # refused before the NVMe directory, so before training


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    code, err = _run(tmp_path, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml' does not exist" in _one_line(err)


def test_verbose_shows_the_traceback(tmp_path: Path) -> None:
    code, err = _run(tmp_path, "-v", "train.steps=0")
    assert code != 0 and "Traceback" in err and "ConfigError" in err


def test_zinf_command_errors_are_one_line(tmp_path: Path) -> None:
    got, err = _run(tmp_path, "consolidate", str(tmp_path / "missing"), str(tmp_path / "model.pt"), module=True)
    assert got == 1 and "missing does not exist" in _one_line(err), err
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("args,code,names", [
    (("report", "{tmp}/missing.log"), 2, "missing.log"),
    (("plan", "--params", "1e6", "--precision", "fp8"), 2, "--precision 'fp8'"),
    (("consolidate", "{tmp}/missing", "{tmp}/model.pt"), 1, "missing does not exist"),
])
def test_zinf_commands_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                  args: tuple[str, ...], code: int, names: str) -> None:
    from zinf.cli import main

    monkeypatch.delenv("ZINF_TRACEBACK", raising=False)
    assert main([a.format(tmp=tmp_path) for a in args]) == code
    assert names in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("args,names", [
    (("{tmp}/out", "--dtype", "fp8"), "--dtype 'fp8' is not a dtype it writes. Pass fp32, bf16 or fp16"),
    (("{tmp}/out", "--format", "onnx"), "--format 'onnx' is not one of torch, safetensors, hf"),
    (("{tmp}/out", "--format", "hf"), "--format hf needs --config PATH"),
    (("{tmp}/out", "--config", "{tmp}/nope"), "--config '{tmp}/nope' does not exist"),
    (("{tmp}/out", "--config", "{tmp}"), "is a directory without config.json"),
    (("{tmp}/out", "--max-shard-size", "5XB"), "--max-shard-size='5XB' is not a size"),
    (("{tmp}/model.pt", "--max-shard-size", "1GB"), "--max-shard-size needs a directory as OUT"),
    (("{tmp}/model.pt", "--format", "hf"), "--format hf writes a directory"),
    (("{tmp}/model.safetensors",), "names a .safetensors file"),
    (("{tmp}/a_file", "--format", "safetensors"), "'{tmp}/a_file' exists and is a file"),
    (("{tmp}/taken",), "already holds files it would not write (notes.txt)"),
])
def test_zinf_consolidate_options_are_checked_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...],
        names: str) -> None:
    from zinf.cli import main

    monkeypatch.delenv("ZINF_TRACEBACK", raising=False)
    (tmp_path / "a_file").write_text("keep me")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep me")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(["consolidate", str(tmp_path / "ckpt"), *(a.format(tmp=tmp_path) for a in args)]) == 2
    assert names.format(tmp=tmp_path) in _one_line(capsys.readouterr().err)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
