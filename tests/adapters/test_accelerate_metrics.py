"""The Accelerate front end sends the engine's step report to the trackers, throttled, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402

from accelerate_zinf import Accelerator  # noqa: E402


class ListTracker(GeneralTracker):
    """Keeps what it is given (Accelerate's built-in trackers all need a package of their own)."""

    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict]] = []

    @property
    def tracker(self) -> list:
        return self.logged

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.logged.append((step, dict(values)))


def _train(accelerator: Accelerator, num_micro_batches: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(num_micro_batches):
        with accelerator.accumulate(model):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()


def test_step_reports_go_to_the_trackers_every_n_optimizer_steps(fresh_state) -> None:
    tracker = ListTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker], gradient_accumulation_steps=2, zinf_report_every=2,
                              zinf_config={"gradient_clipping": 1.0})
    accelerator.init_trackers("zinf-test")
    _train(accelerator, 12)  # 6 optimizer steps: reports after steps 2, 4 and 6
    assert [step for step, _ in tracker.logged] == [2, 4, 6]
    for _, values in tracker.logged:
        assert all(k.startswith("zinf/") and isinstance(v, float) for k, v in values.items())
        assert values["zinf/compute"] > 0 and values["zinf/optimizer"] > 0
        assert values["zinf/bytes_cpu"] > 0 and values["zinf/grad_norm"] > 0
        assert "zinf/io_hidden_share" not in values  # nothing on NVMe
    accelerator.end_training()


def test_no_reports_without_trackers_or_when_turned_off(fresh_state) -> None:
    tracker = ListTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker], zinf_report_every=0)
    accelerator.init_trackers("zinf-test")
    _train(accelerator, 3)
    assert tracker.logged == []
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, zinf_report_every=1)  # no trackers: nothing to log to, no error
    _train(accelerator, 2)
    with pytest.raises(ValueError, match="zinf_report_every"):
        Accelerator(cpu=True, zinf_report_every=-1)
