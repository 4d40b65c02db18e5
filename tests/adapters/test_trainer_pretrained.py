"""transformers' ``Trainer`` under ``zinf launch``, with a script that calls ``from_pretrained`` itself (a model from
a ``save_pretrained`` directory) before it builds its ``TrainingArguments``, against the same script under
Accelerate DDP (tests/adapters/accelerate_trainer_script.py --pretrained): two gloo processes, fp32.

The launcher, not the script, makes ``from_pretrained`` build the model partitioned over both ranks (it joins the
ranks first, as the Trainer will) and load it with zinf's streaming loader: each rank holds about half of the
parameter bytes, still after ``Trainer`` has moved the model to its device, and read about half of the checkpoint's bytes (zinf's "loaded N tensors ... this rank read X of
the files' Y" line). The logged per-step losses are DDP's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import EXAMPLES, accelerate_launch, assert_close, zinf_launch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("accelerate_trainer_script.py")
WORLD = 2
RTOL = 1e-6


def run_records(out: Path) -> tuple[dict, list[dict]]:
    """(rank 0's losses record, each rank's load record)."""
    return json.loads(out.read_text()), [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(WORLD)]


def test_trainer_from_pretrained_under_zinf_launch_streams_partitioned_and_trains_like_ddp(tmp_path: Path) -> None:
    from models import save_llama

    model = save_llama(tmp_path / "llama")
    accelerate_launch(EXAMPLES / "accelerate_cpu.yaml", SCRIPT, tmp_path / "ddp.json", tmp_path / "o1",
                      "--pretrained", model)
    zinf_launch("--config", EXAMPLES / "zinf_cpu.yaml", SCRIPT, tmp_path / "zinf.json", tmp_path / "o2",
                "--pretrained", model)
    ddp, ddp_loads = run_records(tmp_path / "ddp.json")
    ours, our_loads = run_records(tmp_path / "zinf.json")
    assert (ddp["accelerator"], ours["accelerator"]) == ("accelerate.accelerator", "accelerate_zinf.accelerator")

    for rank, r in enumerate(our_loads):
        assert 0.49 < r["resident_share"] < 0.52, f"rank {rank} holds {r['resident_share']:.3f} of the model"
        # Trainer moves the model to args.device (cpu:0): a dense copy of every placeholder would be the whole model
        assert r["resident_share_in_trainer"] == r["resident_share"], (rank, r)
        (load,) = r["loads"]  # the streaming loader, not whole-model loading on each rank
        assert 0.45 < load["read_bytes"] / load["file_bytes"] < 0.62, (rank, load)
    assert all(r["resident_share"] == 1.0 and not r["loads"] for r in ddp_loads)

    assert len(ours["losses"]) == 10
    assert_close(ddp["losses"], ours["losses"], RTOL)
