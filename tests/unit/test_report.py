import math

import pytest
import torch
from torch import nn

import zinf
from zinf.report import StepReport


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


def test_io_hidden_share_formula() -> None:
    seconds = {"compute": 1.0, "nvme_read": 0.1, "nvme_write": 0.1,
               "background_nvme_read": 0.5, "background_nvme_write": 0.3, "optimizer_wait": 0.2}
    r = _report(seconds=seconds, counts={"nvme_read_bytes": 10, "nvme_written_bytes": 20},
                bytes={"cpu": {"master": 8}, "nvme": {"optimizer_state": 1000}})
    # hidden = background 0.8 - optimizer_wait 0.2 = 0.6 of foreground 0.2 + background 0.8
    assert math.isclose(r.io_hidden_share, 0.6)
    m = r.metrics()
    assert math.isclose(m["zinf/io_hidden_share"], 0.6)
    assert m["zinf/bytes_nvme"] == 1000.0 and m["zinf/nvme_read_bytes"] == 10.0 and m["zinf/nvme_written_bytes"] == 20.0
    assert m["zinf/background_nvme_read"] == 0.5 and m["zinf/optimizer_wait"] == 0.2
    assert "io_hidden 60%" in r.summary() and "background_nvme_write 300.0 ms" in r.summary()
    # an optimizer wait longer than the background I/O cannot make the share negative
    assert _report(seconds={"background_nvme_read": 0.1, "optimizer_wait": 5.0}).io_hidden_share == 0.0
    # only training-thread waits: nothing hidden
    assert _report(seconds={"nvme_read": 0.1}).io_hidden_share == 0.0
    # bytes moved without a measurable wait: all hidden
    assert _report(counts={"nvme_read_bytes": 4096}).io_hidden_share == 1.0


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
