"""The path of a module entering its forward, followed call by call (``sys.setprofile``) on step 2 with 2 gloo
ranks: the pre-forward hook of one block (not the root), its gathers, the round that agrees on them and the prefetch
of the next blocks. The path stays short, every call goes to the same layer or a lower one (the layer map of
tests/layers.py), and the streams module is entered only where work is made in flight and where it is joined."""

from __future__ import annotations

import collections
import os
import sys
from types import FrameType
from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from layers import LAYERS, layer_of
from models import GPT, GPTConfig, batches, make_optimizer

pytestmark = pytest.mark.distributed

_ZINF = os.path.dirname(zinf.__file__)


def _module_of(path: str) -> str | None:
    if not path.startswith(_ZINF + os.sep):
        return None
    rel = os.path.relpath(path, os.path.dirname(_ZINF))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _walk(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with zinf.Init():
        model = GPT(GPTConfig())
    engine = zinf.initialize(model, make_optimizer(model))
    target = model.blocks[1]
    calls: list[tuple[str, str, str]] = []  # (caller module, callee module, callee function)
    depth = [0]  # > 0 inside the target's pre-forward hook
    streams_entries = [0]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and depth[0] == 0:
            if code.co_name == "_forward_pre" and frame.f_locals.get("module") is target:
                depth[0] = 1
            return
        if depth[0] == 0 or event not in ("call", "return"):
            return
        if event == "return":
            depth[0] -= 1
            return
        depth[0] += 1
        callee = _module_of(code.co_filename)
        caller = _module_of(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if callee is None:
            return
        calls.append((caller or "", callee, code.co_name))
        if callee == "zinf.runtime.streams" and caller != "zinf.runtime.streams":
            streams_entries[0] += 1

    for step, (x, y) in enumerate(batches("gpt", 3, 4)):
        if step == 1:
            sys.setprofile(profile)
        loss = engine(x, y)
        sys.setprofile(None)
        engine.backward(loss)
        engine.step()
    engine.close()
    return {"calls": calls, "streams_entries": streams_entries[0]}


def test_a_module_entering_its_forward_takes_a_short_downward_path() -> None:
    for rank, result in enumerate(run_distributed(_walk, 2)):
        calls = result["calls"]
        assert calls, "the target's pre-forward hook was not followed"
        files = sorted({callee for _, callee, _ in calls})
        assert len(files) <= 10, f"rank {rank}: {len(files)} modules of zinf entered: {files}"
        climbs = collections.Counter(
            f"{caller} -> {callee}.{name}" for caller, callee, name in calls
            if caller and layer_of(caller) is not None and layer_of(callee) is not None
            and layer_of(callee) > layer_of(caller))  # type: ignore[operator]
        assert not climbs, f"rank {rank}: calls from a lower layer into a higher one: {dict(climbs)}"
        joins = sum(1 for _, callee, name in calls if callee == "zinf.runtime.streams" and name == "join")
        issued = sum(1 for _, callee, name in calls if callee == "zinf.runtime.collectives" and name in
                     ("issue", "all_gather", "serve_all_gather"))
        assert result["streams_entries"] <= 2 * max(1, joins + issued), (
            rank, result["streams_entries"], joins, issued, collections.Counter(
                f"{c} -> {n}" for c, callee, n in calls if callee == "zinf.runtime.streams" and c != callee))
        assert [name for name, _ in LAYERS][0] == "base"
