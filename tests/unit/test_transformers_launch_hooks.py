"""``zinf.integrations.transformers.enable`` as a launcher calls it (``zinf launch``: before the script, so before
transformers' model code is imported), in a fresh interpreter: ``from_pretrained`` is wrapped once (the import hook
and ``enable`` both install; wrapping the wrappers recursed forever), the launcher's ``start`` runs before the
model is built when there is no process group yet, and the model comes out partitioned."""

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


def test_enable_before_transformers_is_imported_wraps_once_and_starts_the_ranks(tmp_path: Path) -> None:
    from models import save_llama

    save_llama(tmp_path / "llama")
    cmd = [sys.executable, "-c", _SCRIPT, str(tmp_path / "llama")]
    proc = processes.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("partitioned"), proc.stdout
