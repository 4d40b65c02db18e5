import math
import time

import pytest
import torch
from torch import nn

import zinf
from zinf.report import StepReport, StepTimers, io_overlap


def _report(**kwargs) -> StepReport:
    base = dict(step=3, seconds={"compute": 0.5, "all_gather": 0.1, "reduce_scatter": 0.05, "optimizer": 0.2},
                counts={"prefetched_gathers": 4, "demand_gathers": 1},
                bytes={"device": {"param_shards": 100, "gathered": 50}, "cpu": {"master": 400}},
                peak_gathered_bytes=60)
    base.update(kwargs)
    return StepReport(**base)


def test_metrics_flat_and_prefixed() -> None:
    m = _report(grad_norm=1.5, loss_scale=1024.0).metrics()
    assert all(k.startswith("zinf/") and isinstance(v, float) for k, v in m.items())
    assert m["zinf/compute"] == 0.5 and m["zinf/all_gather"] == 0.1 and m["zinf/optimizer"] == 0.2
    assert m["zinf/bytes_device"] == 150.0 and m["zinf/bytes_cpu"] == 400.0 and "zinf/bytes_nvme" not in m
    assert m["zinf/peak_gathered_bytes"] == 60.0 and m["zinf/prefetched_gathers"] == 4.0
    assert m["zinf/grad_norm"] == 1.5 and m["zinf/loss_scale"] == 1024.0 and m["zinf/skipped"] == 0.0
    # without NVMe there is no I/O to hide
    assert "zinf/io_hidden_share" not in m and _report().io_hidden_share is None
    m = _report(skipped=True).metrics()
    assert "zinf/grad_norm" not in m and "zinf/loss_scale" not in m and m["zinf/skipped"] == 1.0


def test_io_hidden_share_from_the_waits_intervals() -> None:
    """[Note: I/O hidden share]: the training thread waits 0.1 s for a read; the background optimizer waits for reads
    and writes over [0.2, 1.0] s; the training thread waits for that step over [0.5, 0.9] s."""
    intervals = {"nvme_read": [(0.0, 0.1)], "background_nvme_read": [(0.2, 0.7)],
                 "background_nvme_write": [(0.6, 1.0)], "optimizer_wait": [(0.5, 0.9)]}
    overlap = io_overlap(intervals)
    assert math.isclose(overlap["io_busy"], 0.9) and math.isclose(overlap["io_stalled"], 0.1 + 0.4)
    seconds = {"compute": 1.0, "nvme_read": 0.1, "background_nvme_read": 0.5, "background_nvme_write": 0.4,
               "optimizer_wait": 0.4, "step_wall": 2.5, **overlap}
    r = _report(seconds=seconds, counts={"nvme_read_bytes": 10, "nvme_written_bytes": 20},
                bytes={"cpu": {"master": 8}, "nvme": {"optimizer_state": 1000}})
    assert math.isclose(r.io_hidden_share, 1 - 0.5 / 0.9) and r.disk_utilisation is None  # no measured speed
    m = r.metrics()
    assert math.isclose(m["zinf/io_hidden_share"], 1 - 0.5 / 0.9) and "zinf/disk_utilisation" not in m
    assert m["zinf/bytes_nvme"] == 1000.0 and m["zinf/nvme_read_bytes"] == 10.0 and m["zinf/nvme_written_bytes"] == 20.0
    assert m["zinf/background_nvme_read"] == 0.5 and m["zinf/optimizer_wait"] == 0.4
    assert "io_hidden 44%" in r.summary() and "background_nvme_write 400.0 ms" in r.summary()
    # the disk needed 2 s for the bytes: I/O that finished before anyone waited still took it
    floored = _report(seconds={**seconds, "nvme_floor": 2.0}, counts=r.counts)
    assert math.isclose(floored.io_hidden_share, 1 - 0.5 / 2.0) and math.isclose(floored.disk_utilisation, 2.0 / 2.5)
    assert "io_hidden 75%" in floored.summary() and "disk_busy 80%" in floored.summary()
    # waits for the optimizer while it computes, not waits for I/O, stall no I/O
    assert io_overlap({"background_nvme_read": [(0.0, 0.1)], "optimizer_wait": [(0.2, 5.0)]})["io_stalled"] == 0.0
    # only training-thread waits: nothing hidden
    assert _report(seconds=io_overlap({"nvme_read": [(0.0, 0.1)]})).io_hidden_share == 0.0
    # bytes moved without a measurable wait: all hidden
    assert _report(counts={"nvme_read_bytes": 4096}).io_hidden_share == 1.0


def test_step_timers_keep_the_waits_intervals() -> None:
    timers = StepTimers()
    with timers.time("background_nvme_read"):
        time.sleep(0.01)
    with timers.time("compute"):
        pass
    seconds, _ = timers.take()
    assert seconds["io_busy"] == pytest.approx(seconds["background_nvme_read"]) and seconds["io_stalled"] == 0.0
    assert seconds["step_wall"] >= seconds["background_nvme_read"]
    seconds, _ = timers.take()
    assert "io_busy" not in seconds  # nothing carried into the next step


def test_engine_report_metrics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = engine(torch.randn(4, 8)).sum()
    engine.backward(loss)
    engine.step()
    m = engine.report().metrics()
    assert m["zinf/compute"] > 0 and m["zinf/bytes_cpu"] > 0
    assert {"zinf/all_gather", "zinf/reduce_scatter", "zinf/optimizer"} <= set(m)
    assert "zinf/io_hidden_share" not in m


@pytest.mark.parametrize("skipped", [False, True])
def test_summary_keeps_format(skipped: bool) -> None:
    line = _report(skipped=skipped).summary()
    assert line.startswith("step 3 | compute 500.0 ms | all_gather 100.0 ms")
    assert "cpu 0.0 MiB" in line and ("skipped (overflow)" in line) == skipped and "io_hidden" not in line


def test_broadcast_buffers_is_shown_when_timed_and_counted_in_the_step() -> None:
    from zinf.inspect_cli import parse_summary

    seconds = {"compute": 0.5, "all_gather": 0.1, "reduce_scatter": 0.05, "optimizer": 0.2, "broadcast_buffers": 0.01}
    line = _report(seconds=seconds).summary()
    assert "optimizer 200.0 ms | broadcast_buffers 10.0 ms" in line
    assert _report(seconds=seconds).metrics()["zinf/broadcast_buffers"] == 0.01
    assert "broadcast_buffers" not in _report().summary() and "zinf/broadcast_buffers" not in _report().metrics()
    parsed = parse_summary("zinf: " + line)  # zinf report: a wait on the training thread, outside compute
    assert parsed is not None and math.isclose(parsed.step_ms, 860.0)
