"""zinf/update/accumulation.py: what the gradient shards hold between steps, and what a backward that raised leaves
([Note: a backward that raised])."""

from __future__ import annotations

import pytest

from zinf.errors import ZinfError
from zinf.update.accumulation import Accumulation, GradsHeld


def test_a_first_backward_that_raised_is_dropped_and_one_after_others_mixes() -> None:
    grads = Accumulation()
    before = grads.snapshot()
    grads.begin_backward()
    assert grads.backward_raised(before)  # nothing else held: the caller drops its partial gradients
    grads.clear()
    grads.begin_backward()  # a micro-batch whose backward completes
    before = grads.snapshot()
    grads.begin_backward()
    assert not grads.backward_raised(before) and grads.state is GradsHeld.MIXED
    with pytest.raises(ZinfError, match=r"zero_grad\(\)"):
        grads.check_step()
    grads.begin_backward()  # a later backward does not make the shards clean again
    assert grads.state is GradsHeld.MIXED
    grads.clear()
    grads.check_step()
    assert grads.state is GradsHeld.NONE and not grads.unscaled and not grads.clipped


def test_a_backward_that_raised_before_any_module_added_nothing() -> None:
    grads = Accumulation()
    grads.begin_backward()
    before = grads.snapshot()  # e.g. "Trying to backward through the graph a second time", before any hook ran
    assert not grads.backward_raised(before) and grads.state is GradsHeld.ACCUMULATED
    grads.check_step()
