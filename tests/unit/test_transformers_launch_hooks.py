"""``zinf.integrations.transformers.enable`` as a launcher calls it (``zinf launch``: before the script, so before
transformers' model code is imported), in a fresh interpreter: ``from_pretrained`` is wrapped once (the import hook
and ``enable`` both install; wrapping the wrappers recursed forever), the launcher's ``start`` runs before the
model is built when there is no process group yet, and the model comes out partitioned. Trainer's save and load steps
are wrapped by the same kind of import hook."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import processes

pytest.importorskip("transformers")

_SCRIPT = """
import sys
import torch
import zinf
from zinf.integrations import transformers as hf
from zinf.param.registry import group_of

assert "transformers.modeling_utils" not in sys.modules
started = []
hf.enable(zinf.ZeroConfig(), start=lambda: started.append(True))
from transformers import AutoModelForCausalLM

original = hf._originals["from_pretrained"].__func__
assert original.__module__ == "transformers.modeling_utils", original.__module__
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
assert started == [True], started
assert all(group_of(p) is not None for p in model.parameters())
print("partitioned", sum(p.numel() for p in model.parameters()))
"""


@pytest.mark.slow
def test_enable_before_transformers_is_imported_wraps_once_and_starts_the_ranks(tmp_path: Path) -> None:
    from models import save_llama

    save_llama(tmp_path / "llama")
    cmd = [sys.executable, "-c", _SCRIPT, str(tmp_path / "llama")]
    proc = processes.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("partitioned"), proc.stdout


_TRAINER_SCRIPT = """
import sys
import zinf
from zinf.integrations import trainer as hooks

assert "transformers.trainer" not in sys.modules
zinf.integrations.activate()  # as zinf launch does before the script runs
from transformers import Seq2SeqTrainer, Trainer

assert hooks._originals, "importing transformers' Trainer after activate() wraps it"
assert hooks.install()  # a second install (a launcher's, say) wraps nothing again
for name in hooks._WRAPPED:
    assert getattr(Trainer, name).__module__ == "zinf.integrations.trainer", name
    assert getattr(Seq2SeqTrainer, name) is getattr(Trainer, name), name
    assert hooks._originals[name].__module__ == "transformers.trainer", name
print("wrapped", len(hooks._WRAPPED))
"""


@pytest.mark.slow
def test_trainer_methods_are_wrapped_once_when_transformers_trainer_is_imported() -> None:
    """zinf's integrations activated first (as ``zinf launch`` does): importing transformers' Trainer wraps
    its save and load steps once, for its subclasses too, the originals kept (zinf/integrations/trainer.py)."""
    proc = processes.run([sys.executable, "-c", _TRAINER_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("wrapped 5"), proc.stdout
