"""The hooks' pass phase (zinf/schedule/pass_state.py): its transitions, and the ones it refuses."""

from __future__ import annotations

import pytest

from zinf.schedule.pass_state import ModuleTrace, PassPhase, PassState
from zinf.schedule.rounds import Post


def test_forward_then_backward() -> None:
    state, trace = PassState(), ModuleTrace("forward")
    state.begin_forward(trace, grad=True)
    assert state.phase is PassPhase.FORWARD and state.in_forward and state.end_post is Post.END_FORWARD
    assert state.end_forward() is trace and state.phase is PassPhase.IDLE and state.trace is None
    state.begin_backward()
    assert state.in_backward and not state.in_forward
    state.end_backward()
    assert state.phase is PassPhase.IDLE


def test_eval_forward_ends_with_its_own_post() -> None:
    state = PassState()
    state.begin_forward(ModuleTrace("eval forward"), grad=False)
    assert state.phase is PassPhase.EVAL and state.end_post is Post.END_EVAL


def test_a_backward_inside_a_forward_resumes_it() -> None:
    state, trace = PassState(), ModuleTrace("forward")
    state.begin_forward(trace, grad=True)
    state.begin_backward()  # torch.autograd.grad inside the model's forward
    assert state.in_backward and state.trace is trace
    state.end_backward()
    assert state.phase is PassPhase.FORWARD and state.end_forward() is trace


def test_abandoned_forward() -> None:
    state, trace = PassState(), ModuleTrace("forward")
    assert state.abandon_forward() is None
    state.begin_forward(trace, grad=True)
    assert state.abandon_forward() is trace and state.phase is PassPhase.IDLE
    state.begin_forward(trace, grad=True)
    state.begin_backward()
    assert state.abandon_forward() is trace  # the forward raised out of a backward it started
    state.end_backward()
    assert state.phase is PassPhase.IDLE


def test_transitions_from_the_wrong_phase_are_refused() -> None:
    state, trace = PassState(), ModuleTrace("forward")
    with pytest.raises(AssertionError):
        state.end_forward()
    with pytest.raises(AssertionError):
        state.end_backward()
    state.begin_forward(trace, grad=True)
    with pytest.raises(AssertionError):
        state.begin_forward(trace, grad=True)
    state.begin_backward()
    with pytest.raises(AssertionError):
        state.begin_backward()


def test_busy_counts_nested_hook_bodies() -> None:
    state = PassState()
    state.enter()
    state.enter()
    state.leave()
    assert state.busy == 1
    state.leave()
    assert state.busy == 0
