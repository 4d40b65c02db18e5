"""Lightning: a LightningModule whose ``configure_model`` calls transformers' ``from_pretrained`` (once), trained with
``Trainer(accelerator="cpu", devices=2, strategy="zero_infinity")`` against ``strategy="ddp"``: fp32, gradient
accumulation 2 and clipping (tests/adapters/lightning_driver.py --pretrained).

Under zinf, ``configure_model`` runs inside ``zinf.Init``, so the model comes out of ``from_pretrained`` partitioned
(each rank holds about half of the parameter bytes when ``configure_optimizers`` runs) and each rank read about
half of the checkpoint's bytes; every rank's per-micro-batch losses are DDP's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_runs import Runs, records, worst

pytest.importorskip("lightning")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RTOL = 1e-6
ARGS = ("--kind", "llama", "--steps", "6", "--accum", "2", "--clip", "0.5")


def test_from_pretrained_in_configure_model_is_partitioned_and_trains_like_ddp(tmp_path: Path) -> None:
    from models import save_llama

    model = str(save_llama(tmp_path / "llama"))
    runs = Runs(tmp_path)
    ours = records(runs("lightning_driver.py", "--strategy", "zero_infinity", *ARGS, "--pretrained", model))
    ref = records(runs("lightning_driver.py", "--strategy", "ddp", *ARGS, "--pretrained", model))

    for rank, r in enumerate(ours):
        assert 0.49 < r["resident_share"] < 0.52, f"rank {rank} holds {r['resident_share']:.3f} of the model"
        (load,) = r["loads"]
        assert 0.45 < load["read_bytes"] / load["file_bytes"] < 0.62, (rank, load)
    assert all(r["resident_share"] == 1.0 and not r["loads"] for r in ref)

    assert len(ours[0]["train"]) == 12 and ours[0]["global_step"] == 6
    assert worst(ours, ref) <= RTOL
