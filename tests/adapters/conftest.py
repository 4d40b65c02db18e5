"""Fixtures shared by the adapter tests."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: each one-process Accelerate test starts and ends
    without them (and without a zinf config from the environment)."""
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_zinf.settings import ENV_CONFIG

    monkeypatch.delenv(ENV_CONFIG, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
