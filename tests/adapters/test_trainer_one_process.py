"""transformers' ``Trainer`` on zinf in this one process (its ``Accelerator`` is zinf's, as ``zinf launch`` makes it),
against the same Trainer on Accelerate's own: evaluating before training, loading the best of ``save_only_model``
checkpoints at the end (a whole model, and a peft adapter), and the dtype of the weights it saves under bf16 mixed
precision (see [Note: Trainer checkpoints under zinf] in zinf/integrations/trainer.py). The same on two gloo
processes under ``zinf launch``: test_trainer_like_ddp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from token_data import Tokens  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import accelerate_zinf  # noqa: E402
import zinf  # noqa: E402
from zinf.integrations.trainer import engine_of  # noqa: E402

pytestmark = pytest.mark.slow  # about 10 s: a transformers model built and trained in process

BEST_ONLY_MODEL = dict(max_steps=6, eval_strategy="steps", eval_steps=2, save_steps=2, save_only_model=True,
                       load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _trainer(model: torch.nn.Module, outdir: Path, on_zinf: bool, monkeypatch: pytest.MonkeyPatch,
             **settings: Any) -> Trainer:
    """A Trainer whose Accelerator is zinf's (``on_zinf``) or Accelerate's, each from fresh Accelerate state."""
    import transformers.trainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    monkeypatch.setattr(transformers.trainer, "Accelerator",
                        accelerate_zinf.Accelerator if on_zinf else accelerate_zinf.Accelerator.__bases__[0])
    zinf.integrations.activate()
    args = TrainingArguments(output_dir=str(outdir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             learning_rate=2e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
                             seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **settings)
    return Trainer(model=model, args=args, train_dataset=Tokens(64, 16, 128, seed=7),
                   eval_dataset=Tokens(8, 16, 128, seed=8))


def _both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Callable[[Trainer], Any],
          model: Callable[[], torch.nn.Module] = _gpt2, **settings: Any) -> tuple[Any, Any]:
    """``run(trainer)`` on Accelerate's Trainer, then on zinf's; the zinf engines closed afterwards."""
    plain = run(_trainer(model(), tmp_path / "plain", False, monkeypatch, **settings))
    trainer = _trainer(model(), tmp_path / "zinf", True, monkeypatch, **settings)
    try:
        return plain, run(trainer)
    finally:
        trainer.accelerator.end_training()


def _losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_evaluate_before_train_then_train_as_without_zinf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          fresh_state: None) -> None:
    def run(trainer: Trainer) -> dict:
        first = trainer.evaluate()["eval_loss"]
        trainer.train()
        assert engine_of(trainer) is None or engine_of(trainer).optimizer is not None  # built again with it
        return {"evaluations": [first, trainer.evaluate()["eval_loss"]], "losses": _losses(trainer)}

    plain, ours = _both(tmp_path, monkeypatch, run, max_steps=4, save_strategy="no")
    assert len(ours["losses"]) == 4
    torch.testing.assert_close(ours["evaluations"], plain["evaluations"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["losses"], plain["losses"], rtol=1e-5, atol=0)


def test_best_save_only_model_checkpoint_is_loaded_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              fresh_state: None) -> None:
    def run(trainer: Trainer) -> dict[str, torch.Tensor]:
        trainer.train()
        assert trainer.state.best_model_checkpoint == str(Path(trainer.args.output_dir) / "checkpoint-2")
        return trainer.accelerator.get_state_dict(trainer.model_wrapped)

    plain, ours = _both(tmp_path, monkeypatch, run, **BEST_ONLY_MODEL)
    for name, final in [("plain", plain), ("zinf", ours)]:
        best = load_file(tmp_path / name / "checkpoint-2" / "model.safetensors")
        last = load_file(tmp_path / name / "checkpoint-6" / "model.safetensors")
        assert all(torch.equal(final[k], best[k]) for k in best), name  # the best, not the last, weights
        assert any(not torch.equal(final[k], last[k]) for k in last), name


def test_best_save_only_model_adapter_is_loaded_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           fresh_state: None) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    def lora() -> torch.nn.Module:
        return get_peft_model(_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                  init_lora_weights=False))

    def run(trainer: Trainer) -> tuple[dict[str, torch.Tensor], str]:
        trainer.train()
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        return {k: v for k, v in state.items() if "lora_" in k}, Path(trainer.state.best_model_checkpoint).name

    plain, ours = _both(tmp_path, monkeypatch, run, model=lora, **BEST_ONLY_MODEL)
    assert plain[1] == ours[1] != "checkpoint-6"
    for name, (final, checkpoint) in [("plain", plain), ("zinf", ours)]:
        assert len(final) == 4, name  # lora_A and lora_B of c_attn in 2 layers
        best = load_file(tmp_path / name / checkpoint / "adapter_model.safetensors")
        last = load_file(tmp_path / name / "checkpoint-6" / "adapter_model.safetensors")
        key = {k: k.replace(".default", "") for k in final}
        assert all(torch.equal(final[k], best[key[k]]) for k in final), name
        assert any(not torch.equal(final[k], last[key[k]]) for k in final), name


def test_bf16_weights_are_saved_in_the_dtype_the_model_was_built_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    fresh_state: None) -> None:
    from zinf.checkpoint import consolidate

    def run(trainer: Trainer) -> dict[str, torch.Tensor]:
        trainer.train()
        trainer.save_model(str(Path(trainer.args.output_dir) / "final"))
        return trainer.accelerator.get_state_dict(trainer.model_wrapped)

    _, ours = _both(tmp_path, monkeypatch, run, max_steps=2, save_steps=2, bf16=True)
    for where in ("checkpoint-2", "final"):
        plain = load_file(tmp_path / "plain" / where / "model.safetensors")
        saved = load_file(tmp_path / "zinf" / where / "model.safetensors")
        assert {k: v.dtype for k, v in saved.items()} == {k: v.dtype for k, v in plain.items()}, where  # fp32
        assert all(torch.equal(v, ours[k]) for k, v in saved.items()), where  # the fp32 masters, as gathered
    shards = consolidate(tmp_path / "zinf" / "checkpoint-2" / "zinf")
    assert all(torch.equal(v, shards[k]) for k, v in saved.items())
