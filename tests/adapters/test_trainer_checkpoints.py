"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` + PEFT LoRA save, rotate, keep their best model and resume under
``zinf launch``, with the scripts unchanged (trainer_checkpoint_script.py, sft_checkpoint_script.py): two gloo
processes, fp32, each scenario one run and one run resumed from its middle checkpoint (see [Note: Trainer
checkpoints under zinf] in zinf/integrations/trainer.py).

What is checked, in this process with plain transformers / peft: each ``checkpoint-N`` holds what Trainer writes
there (the model's ``config.json`` + ``model.safetensors``, or the adapter's files only, the scheduler, every rank's
RNG state, the trainer state) plus zinf's shards and no ``optimizer.pt``; ``save_total_limit=2`` keeps the best and
the last checkpoint; ``from_pretrained`` / ``PeftModel.from_pretrained`` of a checkpoint and of ``save_model``'s
directory load the weights the run's gathered state dict holds (after ``load_best_model_at_end``: the best
checkpoint's), and the last checkpoint's weights equal its zinf shards'; the resumed run logs the uninterrupted
run's losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launching import EXAMPLES, assert_close, zinf_launch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).parent
RTOL = 1e-6
COMMON = {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json", "training_args.bin", "zinf"}
SHARDS = {"commit.json", "commit.lock"}


def run(script: str, out: Path, *args: str | Path, resume: bool = False) -> dict:
    zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", HERE / script, *args, *(["--resume"] if resume else []))
    result = json.loads(out.read_text())
    assert result["world"] == 2, "each process trained alone"
    return result


def check_files(checkpoint: Path, expected: set[str]) -> None:
    assert {p.name for p in checkpoint.iterdir()} == expected | COMMON, checkpoint
    parts = sorted(p.name for p in (checkpoint / "zinf").iterdir() if p.name not in SHARDS)
    assert len(parts) == 2 and all(f"rank0000{r}-of-00002" in parts[r] for r in range(2)), parts


def resume_from(first: Path, step: int, into: Path) -> None:
    """A new output directory whose last checkpoint is ``first``'s ``checkpoint-<step>``."""
    into.mkdir()
    shutil.copytree(first / f"checkpoint-{step}", into / f"checkpoint-{step}")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:4]
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:4]


def test_trainer_saves_rotates_loads_best_and_resumes_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from zinf.checkpoint import consolidate

    script = "trainer_checkpoint_script.py"
    first = run(script, tmp_path / "a.json", tmp_path / "a.json", tmp_path / "a", tmp_path / "a_final")
    assert len(first["losses"]) == 8 and len(first["eval_losses"]) == 4
    # rotation at save_total_limit=2 keeps the best (the first, highest eval loss) and the last checkpoint
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["checkpoint-2", "checkpoint-8"]
    assert first["best"] == str(tmp_path / "a" / "checkpoint-2")
    weights = {"config.json", "generation_config.json", "model.safetensors"}
    for step in (2, 8):
        check_files(tmp_path / "a" / f"checkpoint-{step}", weights)
    assert {p.name for p in (tmp_path / "a_final").iterdir()} == weights | {"training_args.bin"}

    def loaded(path: Path) -> dict[str, torch.Tensor]:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()

    # the final model is the best checkpoint's (load_best_model_at_end), as the run's gathered state dict shows
    gathered = torch.load(tmp_path / "a.json.pt")
    assert_same(loaded(tmp_path / "a_final"), gathered)
    assert_same(loaded(tmp_path / "a" / "checkpoint-2"), gathered)
    last = loaded(tmp_path / "a" / "checkpoint-8")
    assert_same(last, consolidate(tmp_path / "a" / "checkpoint-8" / "zinf"))
    assert max((last[k] - gathered[k]).abs().max() for k in last) > 1e-3  # it trained on after the best

    resume_from(tmp_path / "a", 2, tmp_path / "b")
    resumed = run(script, tmp_path / "b.json", tmp_path / "b.json", tmp_path / "b", tmp_path / "b_final", resume=True)
    assert_close(first["losses"], resumed["losses"], RTOL)
    assert_close(first["eval_losses"], resumed["eval_losses"], RTOL)
    assert_same(loaded(tmp_path / "b" / "checkpoint-8"), last)


def test_sft_lora_checkpoints_hold_the_adapter_and_resume_exactly(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from test_trl_peft import build_model_dir
    from zinf.checkpoint import consolidate

    model_dir = build_model_dir(tmp_path / "pretrained")
    script = "sft_checkpoint_script.py"
    first = run(script, tmp_path / "a.json", model_dir, tmp_path / "a", tmp_path / "a_final", tmp_path / "a.json")
    assert len(first["losses"]) == 8 and len(first["eval_losses"]) == 2
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["README.md", "checkpoint-4", "checkpoint-8"]
    assert first["best"] == str(tmp_path / "a" / "checkpoint-4")
    adapter = {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json",
               "tokenizer_config.json"}
    for step in (4, 8):
        check_files(tmp_path / "a" / f"checkpoint-{step}", adapter)
    # the adapter only: LoRA A and B of q_proj and v_proj in 2 layers, no base weight
    assert len(load_file(tmp_path / "a" / "checkpoint-8" / "adapter_model.safetensors")) == 8

    def loaded(path: Path) -> dict[str, torch.Tensor]:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return {k: v for k, v in PeftModel.from_pretrained(base, path).state_dict().items() if "lora_" in k}

    gathered = torch.load(tmp_path / "a.json.pt")
    assert_same(loaded(tmp_path / "a_final"), gathered)
    assert_same(loaded(tmp_path / "a" / "checkpoint-4"), gathered)
    last = loaded(tmp_path / "a" / "checkpoint-8")
    shards = consolidate(tmp_path / "a" / "checkpoint-8" / "zinf")
    assert_same(last, {k: shards[k] for k in last})
    assert max((last[k] - gathered[k]).abs().max() for k in last) > 1e-3

    resume_from(tmp_path / "a", 4, tmp_path / "b")
    resumed = run(script, tmp_path / "b.json", model_dir, tmp_path / "b", tmp_path / "b_final", tmp_path / "b.json",
                  resume=True)
    assert_close(first["losses"], resumed["losses"], RTOL)
    assert_close(first["eval_losses"], resumed["eval_losses"], RTOL)
    assert_same(loaded(tmp_path / "b" / "checkpoint-8"), last)
