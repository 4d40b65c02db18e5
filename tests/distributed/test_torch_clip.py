"""``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` in a training loop clips a zinf model's gradient
shards as it clips plain PyTorch's gradients ([Note: torch's clip on a zinf model] in zinf/update/torch_clip.py).

Two gloo ranks train a small model whose first layer is frozen, calling torch's function (both of its names, with
the parameters as a generator, a list and a reversed list) before every step; plain single-process PyTorch trains
the same model on the same global batches. A part of the model's parameters, another norm, a tensor of no engine
with a gradient, two engines' parameters and a non-finite norm with ``error_if_nonfinite`` raise; after
``engine.close()`` a plain model is clipped by torch's own function.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import zinf
from dist_utils import run_distributed
from models import batches, build, make_optimizer

pytestmark = pytest.mark.distributed

STEPS = 6
MAX_NORM = 0.05  # well under the gradients' norm (about 0.5): every step is clipped
CONFIG = {"gradient_clipping": 0.0}  # the script's own call is the only clipping


def _model() -> nn.Module:
    model = build("twice")
    model.inp.requires_grad_(False)  # frozen: given to the clip with the rest, skipped as torch skips it
    return model


def _arguments(model: nn.Module, step: int) -> Any:
    """The parameters as scripts pass them: a generator, a list, a list in another order."""
    params = list(model.parameters())
    return [model.parameters(), params, params[::-1]][step % 3]


def _clip(step: int) -> Callable[..., torch.Tensor]:
    return torch.nn.utils.clip_grad_norm_ if step % 2 == 0 else torch.nn.utils.clip_grad.clip_grad_norm_


def _reference() -> dict[str, list[float]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = _model()
        opt = make_optimizer(model, "sgd")
        losses, norms = [], []
        for step, (x, y) in enumerate(batches("twice", STEPS, 8)):
            loss = model(x, y)
            loss.backward()
            norms.append(float(_clip(step)(_arguments(model, step), MAX_NORM)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "norms": norms}
    finally:
        torch.set_num_threads(threads)


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except zinf.ZinfError as exc:
        return str(exc)
    return "not refused"


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch_clip = torch.nn.utils.clip_grad_norm_  # torch's own: no engine built yet in this process
    config = zinf.ZeroConfig.from_dict(CONFIG)
    torch.manual_seed(0)
    with zinf.Init(config):
        model = _model()
    engine = zinf.initialize(model, make_optimizer(model, "sgd"), config)
    losses, norms = [], []
    for step, (x, y) in enumerate(batches("twice", STEPS, 8)):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        norms.append(float(_clip(step)(_arguments(model, step), MAX_NORM)))
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)

    x, y = batches("twice", 1, 8, seed=7)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    params = list(model.parameters())
    plain = nn.Linear(2, 2)
    plain(torch.ones(1, 2)).sum().backward()
    torch.manual_seed(0)
    with zinf.Init(config):
        second = build("twice")
    other = zinf.initialize(second, make_optimizer(second, "sgd"), config)
    refused = {
        "subset": _refused(lambda: torch.nn.utils.clip_grad_norm_(params[3:], MAX_NORM)),
        "norm_inf": _refused(lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type="inf")),
        "with_plain": _refused(lambda: torch.nn.utils.clip_grad_norm_(params + list(plain.parameters()), MAX_NORM)),
        "two_engines": _refused(lambda: torch.nn.utils.clip_grad_norm_(params + list(second.parameters()), MAX_NORM)),
    }
    other.close()
    norm_after_refusals = float(engine.grad_norm())  # nothing was clipped by a refused call
    engine.zero_grad()

    nan = torch.full_like(x, float("nan"))
    engine.backward(engine(nan.chunk(world)[rank], y.chunk(world)[rank]))
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=True)
        nonfinite = "not raised"
    except RuntimeError as exc:
        nonfinite = str(exc)
    engine.zero_grad()
    engine.close()

    # after close: a plain model is clipped by torch's own function, as before any engine
    torch.manual_seed(1)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).pow(2).sum().backward()
    got, want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01), torch_clip(b.parameters(), 0.01)
    plain_after_close = bool(torch.equal(got, want) and all(torch.equal(p.grad, q.grad)
                                                            for p, q in zip(a.parameters(), b.parameters())))
    return {"losses": losses, "norms": norms, "refused": refused, "norm_after_refusals": norm_after_refusals,
            "nonfinite": nonfinite, "plain_after_close": plain_after_close, "plain_norm": float(got)}


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    return _reference(), run_distributed(_worker, 2)


def _max_relative(got: list[float], want: list[float]) -> float:
    g, w = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((g - w).abs() / w.abs()).max().item()


def test_torch_clip_matches_pytorch(runs) -> None:
    ref, results = runs
    for rank, got in enumerate(results):
        assert min(got["norms"]) > MAX_NORM, got["norms"]  # every step clipped, none read as 0
        assert _max_relative(got["norms"], ref["norms"]) < 1e-5, (rank, got["norms"], ref["norms"])
        assert _max_relative(got["losses"], ref["losses"]) < 1e-5, (rank, got["losses"], ref["losses"])


def test_part_of_a_model_is_refused(runs) -> None:
    _, results = runs
    for got in results:
        refused = got["refused"]
        assert "was given 3 of its 4 trainable parameters" in refused["subset"], refused["subset"]
        assert "norm_type=inf" in refused["norm_inf"], refused["norm_inf"]
        assert "tensors of no zinf engine that have gradients" in refused["with_plain"], refused["with_plain"]
        assert "parameters of 2 zinf engines" in refused["two_engines"], refused["two_engines"]
        assert all("model.parameters()" in refused[case] for case in ("subset", "with_plain", "two_engines"))
        assert got["norm_after_refusals"] > MAX_NORM  # a refused call clipped nothing


def test_nonfinite_norm_raises_as_torch_does(runs) -> None:
    _, results = runs
    for got in results:
        assert "is non-finite, so it cannot be clipped" in got["nonfinite"], got["nonfinite"]


def test_plain_model_after_close_uses_torch(runs) -> None:
    _, results = runs
    for got in results:
        assert got["plain_after_close"] and got["plain_norm"] > 0.01
