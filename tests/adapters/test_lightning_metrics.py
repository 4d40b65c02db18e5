"""``Trainer(strategy="zero_infinity")`` sends the engine's step report to the Trainer's loggers.

Each case is a real Lightning run with a CSVLogger, started as a script (this file) so that Lightning's
subprocess launcher can start the second rank; the test reads the logger's metrics.csv.

    python test_lightning_metrics.py --out DIR --devices 2 --every 3 --log-every 50
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 6


def _run(out: Path, devices: int, every: int | None, log_every: int) -> list[dict[str, str]]:
    import processes  # here: this file also runs as a script, where tests/ is not on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MASTER_PORT", None)
    args = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--devices", str(devices),
            "--log-every", str(log_every)] + ([] if every is None else ["--every", str(every)])
    proc = processes.run(args, env=env, capture_output=True, text=True, timeout=240, cwd=str(HERE))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    with open(out / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _zinf_rows(rows: list[dict[str, str]]) -> dict[int, dict[str, float]]:
    out = {}
    for row in rows:
        values = {k: float(v) for k, v in row.items() if k.startswith("zinf/") and v != ""}
        if values:
            assert int(row["step"]) not in out, "one report per step"
            out[int(row["step"])] = values
    return out


def _check_sane(values: dict[str, float], world: int) -> None:
    assert values["zinf/compute"] > 0 and values["zinf/optimizer"] > 0 and values["zinf/all_gather"] >= 0
    assert values["zinf/bytes_cpu"] > 0
    assert (values["zinf/peak_gathered_bytes"] > 0) == (world > 1)  # one rank holds every parameter whole
    assert values["zinf/skipped"] == 0.0 and "zinf/io_hidden_share" not in values  # no NVMe here


def test_reports_follow_log_every_n_steps(tmp_path: Path) -> None:
    rows = _run(tmp_path, devices=1, every=None, log_every=2)
    reports = _zinf_rows(rows)
    # the rows Lightning's own self.log uses: global_step before the step, every log_every_n_steps steps
    assert sorted(reports) == [1, 3, 5]
    assert any(row.get("train_loss") and int(row["step"]) == 1 for row in rows)
    for values in reports.values():
        _check_sane(values, world=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_report_every_n_steps_on_two_ranks(tmp_path: Path) -> None:
    reports = _zinf_rows(_run(tmp_path, devices=2, every=3, log_every=50))
    assert sorted(reports) == [2, 5]
    for values in reports.values():
        _check_sane(values, world=2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--every", type=int, default=None, help="ZeroInfinityStrategy(report_every_n_steps=...)")
    p.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...)")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning_driver import GLOBAL_BATCH, LitModel, loader

    import lightning_zinf

    torch.set_num_threads(1)
    strategy = lightning_zinf.ZeroInfinityStrategy(report_every_n_steps=args.every)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=STEPS,
        logger=CSVLogger(args.out, name="csv", version=0), log_every_n_steps=args.log_every,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = LitModel("gpt", "configure_model")
    trainer.fit(model, loader("gpt", STEPS, GLOBAL_BATCH // args.devices))


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import exit_cleanly

    exit_cleanly()
