"""The Accelerate front end, launched for real: two gloo processes through ``accelerate launch`` and
through ``zinf launch``, compared step for step with the same script under plain Accelerate DDP."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launching import EXAMPLES, accelerate_launch, assert_close, run_launcher, zinf_launch

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN = str(EXAMPLES / "train.py")
ARGS = ["--steps", "20", "--grad-accum", "2", "--clip", "1.0"]  # accumulation and clipping in every run
FP32_RTOL = 1e-5
BF16_RTOL = 2e-3  # zinf gathers bf16 weights; Accelerate's DDP autocasts fp32 weights: measured 1.7e-4


def losses(path: Path, accelerator: str) -> list[float]:
    data = json.loads(path.read_text())
    assert data["world"] == 2, "each process trained alone"
    assert data["accelerator"] == accelerator
    return data["losses"]


DDP = "accelerate.accelerator.Accelerator"
ZINF = "accelerate_zinf.accelerator.Accelerator"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The reference: the unchanged script under plain Accelerate DDP (fp32), with its exported model."""
    out = tmp_path_factory.mktemp("ddp")
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", TRAIN, *ARGS, "--losses-out", str(out / "l.json"),
                      "--save-model", str(out / "model"))
    return {"losses": losses(out / "l.json", DDP), "model": out / "model"}


def test_zinf_launch_runs_the_unchanged_script_like_ddp(ddp: dict, tmp_path: Path) -> None:
    zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", TRAIN, *ARGS, "--losses-out", str(tmp_path / "l.json"))
    assert_close(ddp["losses"], losses(tmp_path / "l.json", ZINF), FP32_RTOL)


def test_one_changed_import_under_accelerate_launch_is_like_ddp(ddp: dict, tmp_path: Path) -> None:
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", str(EXAMPLES / "train_zinf.py"), *ARGS,
                      "--losses-out", str(tmp_path / "l.json"))
    assert_close(ddp["losses"], losses(tmp_path / "l.json", ZINF), FP32_RTOL)


@pytest.mark.parametrize("placement", ["cpu_offload", "nvme"])
def test_offload_configs_are_like_ddp(ddp: dict, tmp_path: Path, placement: str) -> None:
    (tmp_path / "nvme").mkdir()
    zinf_launch("--config_file", EXAMPLES / f"zinf_{placement}.yaml", TRAIN, *ARGS,
                "--losses-out", str(tmp_path / "l.json"), env={"ZINF_NVME_DIR": str(tmp_path / "nvme")})
    assert_close(ddp["losses"], losses(tmp_path / "l.json", ZINF), FP32_RTOL)
    assert not any((tmp_path / "nvme").rglob("*.swap")), "swap files left behind"


def test_bf16_is_close_to_ddp_bf16(tmp_path: Path) -> None:
    for name in ("accelerate_cpu", "zinf_cpu"):
        text = (EXAMPLES / f"{name}.yaml").read_text()
        (tmp_path / f"{name}.yaml").write_text(text.replace('mixed_precision: "no"', "mixed_precision: bf16"))
    accelerate_launch(tmp_path / "accelerate_cpu.yaml", TRAIN, *ARGS, "--losses-out", str(tmp_path / "ddp.json"))
    zinf_launch("--config", tmp_path / "zinf_cpu.yaml", TRAIN, *ARGS, "--losses-out", str(tmp_path / "zinf.json"))
    assert_close(losses(tmp_path / "ddp.json", DDP), losses(tmp_path / "zinf.json", ZINF), BF16_RTOL)


def test_save_state_then_load_state_in_a_fresh_launch_resumes_exactly(ddp: dict, tmp_path: Path) -> None:
    """CPU offload (C++ CPU-Adam) with an LR schedule: the first resumed step needs the saved lr too."""
    config, state = EXAMPLES / "zinf_cpu_offload.yaml", str(tmp_path / "state")
    zinf_launch("--config", config, TRAIN, *ARGS, "--save-at", "10", "--save-state", state,
                "--losses-out", str(tmp_path / "first.json"))
    engine_dir = tmp_path / "state" / "zinf_model"
    committed = json.loads((engine_dir / "commit.json").read_text())["files"]  # one file per rank
    assert sorted(p.name for p in engine_dir.iterdir()) == sorted(["commit.json", "commit.lock", *committed])
    assert len(committed) == 2
    zinf_launch("--config", config, TRAIN, *ARGS, "--resume", state, "--losses-out", str(tmp_path / "second.json"),
                "--save-model", str(tmp_path / "model"))
    first, second = losses(tmp_path / "first.json", ZINF), losses(tmp_path / "second.json", ZINF)
    assert (len(first), len(second)) == (10, 10)
    assert_close(ddp["losses"], first + second, FP32_RTOL)

    # the exported model is DDP's exported model (safetensors, tied weight written once)
    from safetensors.torch import load_file

    ours, theirs = load_file(str(tmp_path / "model" / "model.safetensors")), load_file(str(ddp["model"] / "model.safetensors"))
    assert set(theirs) <= set(ours) | {"head.weight", "wte.weight"} and "blocks.0.qkv.weight" in ours
    for name in set(ours) & set(theirs):  # atol: Adam turns 1e-7 gradient noise of the attention key bias (whose
        # gradient is ~0: softmax ignores a per-query constant) into ~1e-5 steps; every other tensor agrees to 3e-7
        assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=5e-5), (name, (ours[name] - theirs[name]).abs().max())


def test_transformers_trainer_trains_on_zinf_through_zinf_launch(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = str(Path(__file__).with_name("accelerate_trainer_script.py"))
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", script, str(tmp_path / "ddp.json"), str(tmp_path / "o1"))
    zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", script, str(tmp_path / "zinf.json"), str(tmp_path / "o2"))
    ddp_run, zinf_run = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ddp", "zinf"))
    assert (ddp_run["accelerator"], zinf_run["accelerator"]) == ("accelerate.accelerator", "accelerate_zinf.accelerator")
    assert len(zinf_run["losses"]) == 10
    assert_close(ddp_run["losses"], zinf_run["losses"], FP32_RTOL)


def test_a_bad_config_stops_zinf_launch_before_any_process_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "zinf_cpu.yaml").read_text().replace("  overlap:", "  ovrlap:"))
    proc = run_launcher([sys.executable, "-m", "zinf.cli", "launch", "--config", str(bad), TRAIN,
                 "--losses-out", str(tmp_path / "l.json")], ok=False)
    assert proc.returncode == 2
    assert "unknown key 'ovrlap'" in proc.stderr and "Did you mean 'overlap'" in proc.stderr and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "l.json").exists()


def test_cpu_processes_that_would_each_train_alone_are_stopped(tmp_path: Path) -> None:
    """Accelerate's trap: use_cpu without ACCELERATE_USE_CPU starts 2 processes that each see a world of 1."""
    proc = run_launcher([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLES / "accelerate_cpu.yaml"),
                 str(EXAMPLES / "train_zinf.py"), "--steps", "2", "--losses-out", str(tmp_path / "l.json")], ok=False)
    assert proc.returncode != 0 and not (tmp_path / "l.json").exists()
    assert "2 processes were launched but Accelerate sees 1" in proc.stderr and "ACCELERATE_USE_CPU=true" in proc.stderr


def test_checkpointing_and_tiling_in_the_zinf_section_are_like_ddp(ddp: dict, tmp_path: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "zinf_cpu.yaml").read_text())
    config["zinf"] = {**(config.get("zinf") or {}), "activation_checkpointing": {"modules": ["Block"], "offload": True},
                      "tiling": {"min_numel": 10000, "tiles": [2, 3]}}
    (tmp_path / "zinf.yaml").write_text(yaml.safe_dump(config))
    zinf_launch("--config", tmp_path / "zinf.yaml", TRAIN, *ARGS, "--losses-out", str(tmp_path / "l.json"))
    assert_close(ddp["losses"], losses(tmp_path / "l.json", ZINF), FP32_RTOL)
