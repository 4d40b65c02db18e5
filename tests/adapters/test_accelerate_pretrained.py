"""``from_pretrained`` in the Accelerate front end, launched for real: two gloo processes under
``ACCELERATE_USE_CPU=true accelerate launch``, fp32, the same loop (AdamW, gradient accumulation 2, clipping,
a fixed per-rank data sequence) with ``from accelerate_zinf import Accelerator`` and the model built by
``from_pretrained`` inside ``accelerator.init_module()``, against plain Accelerate (DDP) and a plain
``from_pretrained`` (tests/adapters/accelerate_pretrained_script.py).

Under zinf the model comes out of ``from_pretrained`` partitioned (each rank holds about half of the parameter
bytes before ``prepare``), each rank read about half of the checkpoint's bytes, and the per-step losses are DDP's
(the gradient sums over ranks and micro-batches run in another order: measured 1e-7 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import EXAMPLES, accelerate_launch, assert_close

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("accelerate_pretrained_script.py")
WORLD = 2
RTOL = 1e-6


def records(prefix: Path) -> list[dict]:
    out = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["world"] == WORLD for r in out), "each process trained alone"
    assert out[0]["losses"] == out[1]["losses"], "the ranks disagree on the global mean loss"
    return out


def test_from_pretrained_in_init_module_is_partitioned_and_trains_like_ddp(tmp_path: Path) -> None:
    from models import save_llama

    model = save_llama(tmp_path / "llama")
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, model, tmp_path / "ddp")
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, model, tmp_path / "zinf", "--zinf")
    ddp, ours = records(tmp_path / "ddp"), records(tmp_path / "zinf")
    assert ddp[0]["accelerator"] == "accelerate.accelerator.Accelerator"
    assert ours[0]["accelerator"] == "accelerate_zinf.accelerator.Accelerator"

    for rank, r in enumerate(ours):  # partitioned at construction: each rank holds about half of the model
        assert 0.49 < r["resident_share"] < 0.52, f"rank {rank} holds {r['resident_share']:.3f} of the model"
        (load,) = r["loads"]  # zinf's streaming loader ran, once, and read about this rank's half of the files
        assert 0.45 < load["read_bytes"] / load["file_bytes"] < 0.62, (rank, load)
    assert all(r["resident_share"] == 1.0 and not r["loads"] for r in ddp)  # the whole model, as DDP keeps it

    assert_close(ddp[0]["losses"], ours[0]["losses"], RTOL)
    assert_close(ddp[0]["grad_norms"], ours[0]["grad_norms"], RTOL)  # clipping saw the same global norm
