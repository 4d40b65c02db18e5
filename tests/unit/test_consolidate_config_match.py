"""``zinf consolidate`` refuses what from_pretrained would load wrongly or not find, before writing anything: a
--config describing another model than the checkpoint holds (names or shapes), and a CKPT that is not the
checkpoint itself but the directory above it (Accelerate's save_state puts the engine's under zinf_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zinf
from models import build, llama_config
from zinf.cli import main

pytestmark = pytest.mark.slow  # about 10 s: transformers models built and consolidated in process

pytest.importorskip("transformers")


def _save(model: torch.nn.Module, path: Path) -> Path:
    engine = zinf.initialize(model)
    engine.save_checkpoint(str(path))
    engine.close()
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny tied Llama's checkpoint and its config directory, and a checkpoint of the test GPT."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("config_match")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config(tied=True))
    llama.config.save_pretrained(root / "llama_config")
    return {"llama": _save(llama, root / "llama_ckpt"), "llama_config": root / "llama_config",
            "gpt": _save(build("gpt"), root / "gpt_ckpt")}


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, code: int) -> str:
    monkeypatch.delenv("ZINF_TRACEBACK", raising=False)
    assert main(["consolidate", *args, "-q"]) == code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_models_own_config_passes_with_tied_weights_written_once(checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert main(["consolidate", str(checkpoints["llama"]), str(out), "--config", str(checkpoints["llama_config"]),
                 "-q"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_another_models_config_is_refused_naming_the_weights(checkpoints, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hf"
    line = _refused([str(checkpoints["gpt"]), str(out), "--config", str(checkpoints["llama_config"])], capsys,
                    monkeypatch, 2)
    assert "--config" in line and "describes another model" in line, line
    assert "missing from the checkpoint (model.layers.0." in line and "does not have (wpe, wte.weight" in line, line
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_a_config_of_another_size_is_refused_naming_the_shapes(checkpoints, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    config = json.loads((checkpoints["llama_config"] / "config.json").read_text())
    config["vocab_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    line = _refused([str(checkpoints["llama"]), str(out), "--config", str(tmp_path / "config.json")], capsys,
                    monkeypatch, 2)
    assert "of another shape (model.embed_tokens.weight [96, 48] (config: [128, 48])" in line, line
    assert not out.exists()


def test_the_directory_above_a_checkpoint_names_it(checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"  # as Accelerate's save_state: its own files, the engine's checkpoint below
    state.mkdir()
    (state / "random_states_0.pkl").write_bytes(b"")
    (state / "zinf_model").symlink_to(checkpoints["llama"], target_is_directory=True)
    line = _refused([str(state), str(tmp_path / "out.pt")], capsys, monkeypatch, 1)
    assert f"Did you mean {state / 'zinf_model'}?" in line, line
    assert not (tmp_path / "out.pt").exists()
