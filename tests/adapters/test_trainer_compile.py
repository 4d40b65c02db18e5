"""``TrainingArguments(torch_compile=True)`` under ``zinf launch``: the unchanged script (trainer_compile_script.py)
compiles on every rank (zinf compiles the model in place, [Note: compiled modules] in zinf/schedule/hooks.py) and
logs the losses of the same script under ``accelerate launch`` DDP; two gloo processes, fp32, the CPU's inductor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import EXAMPLES, accelerate_launch, assert_close, zinf_launch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).parent / "trainer_compile_script.py"


def _ranks(out: Path) -> list[dict]:
    found = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert all(r["world"] == 2 for r in found), "each process trained alone"
    return found


def test_trainer_torch_compile_under_zinf_launch_compiles_and_trains_like_ddp(tmp_path: Path) -> None:
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, tmp_path / "ddp.json", tmp_path / "o1")
    zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", SCRIPT, tmp_path / "zinf.json", tmp_path / "o2")
    ddp, zinf = _ranks(tmp_path / "ddp.json"), _ranks(tmp_path / "zinf.json")
    assert all(r["graphs"] > 0 for r in ddp), "the DDP run compiled nothing: the test's premise"
    assert all(r["graphs"] > 0 for r in zinf), f"zinf launch dropped torch_compile: {[r['graphs'] for r in zinf]}"
    assert_close(ddp[0]["losses"], zinf[0]["losses"], rtol=1e-5)
