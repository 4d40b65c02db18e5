"""transformers' ``Trainer`` under ``zinf launch`` does what it does under plain Accelerate DDP, with the script
unchanged (trainer_like_ddp_script.py; two gloo processes): an evaluation before training, the best of
``save_only_model`` checkpoints (a whole model, a peft adapter) loaded at the end, and weights saved under bf16 mixed
precision in the dtype the model was built in. The same in one process: test_trainer_one_process.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launching import EXAMPLES, accelerate_launch, assert_close, zinf_launch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("trainer_like_ddp_script.py")
FP32_RTOL = 1e-5


def run(tmp_path: Path, scenario: str, ddp: bool = False) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """The script's JSON, its final gathered state dict and its output directory."""
    name = f"{'ddp' if ddp else 'zinf'}_{scenario}"
    out, outdir = tmp_path / f"{name}.json", tmp_path / name
    if ddp:
        accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, out, outdir, scenario)
    else:
        zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", SCRIPT, out, outdir, scenario)
    result = json.loads(out.read_text())
    assert result["world"] == 2, "each process trained alone"
    return result, torch.load(f"{out}.pt"), outdir


def untrained_eval_loss(tmp_path: Path) -> float:
    """``Trainer.evaluate()`` of the script's untrained model on its evaluation set, on Accelerate in this process
    (the same batches of 4 as the two ranks': the same mean)."""
    from token_data import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=str(tmp_path / "untrained"), per_device_eval_batch_size=4, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True)
    return Trainer(model=model, args=args, eval_dataset=Tokens(16, 16, 128, seed=8)).evaluate()["eval_loss"]


def test_evaluate_before_train_then_train_like_ddp(tmp_path: Path, fresh_state: None) -> None:
    ours, _, _ = run(tmp_path, "evaluate_first")
    ddp, _, _ = run(tmp_path, "train_evaluate", ddp=True)
    assert len(ours["losses"]) == 4 and len(ours["evaluations"]) == 2
    assert_close([untrained_eval_loss(tmp_path)], ours["evaluations"][:1], FP32_RTOL)
    assert_close(ddp["losses"], ours["losses"], FP32_RTOL)
    assert_close(ddp["evaluations"], ours["evaluations"][1:], FP32_RTOL)


@pytest.mark.parametrize("scenario", ["best_only_model", "best_only_adapter"])
def test_best_save_only_model_checkpoint_is_loaded_at_the_end(tmp_path: Path, scenario: str) -> None:
    from safetensors.torch import load_file

    result, final, outdir = run(tmp_path, scenario)
    best_dir = Path(result["best"])
    assert best_dir.parent == outdir and best_dir.name != "checkpoint-6"
    weights = "adapter_model.safetensors" if scenario == "best_only_adapter" else "model.safetensors"
    best, last = load_file(best_dir / weights), load_file(outdir / "checkpoint-6" / weights)
    assert not (best_dir / "zinf").exists()  # save_only_model: the weights alone
    key = {k.replace(".default", ""): k for k in final}  # peft saves its parameters without the adapter's name
    assert best.keys() <= key.keys() and len(best) >= 4, sorted(best)[:4]
    assert all(torch.equal(final[key[k]], v) for k, v in best.items())  # the best weights, not the last
    assert any(not torch.equal(final[key[k]], v) for k, v in last.items())


def test_bf16_weights_are_saved_in_the_dtype_the_model_was_built_in(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from zinf.checkpoint import consolidate

    _, ours, outdir = run(tmp_path, "bf16")
    _, _, ddp_dir = run(tmp_path, "bf16", ddp=True)
    for where in ("checkpoint-2", "final"):
        saved = load_file(outdir / where / "model.safetensors")
        theirs = load_file(ddp_dir / where / "model.safetensors")
        assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in theirs.items()}, where  # fp32
        assert all(torch.equal(v, ours[k]) for k, v in saved.items()), where  # the fp32 masters, as gathered
    shards = consolidate(outdir / "checkpoint-2" / "zinf")
    assert all(torch.equal(v, shards[k]) for k, v in load_file(outdir / "checkpoint-2" / "model.safetensors").items())
