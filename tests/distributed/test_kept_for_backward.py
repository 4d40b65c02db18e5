"""[Note: kept for backward] in zinf/schedule/keep.py: the groups the backward gathers first stay gathered from their
last use in the forward (``overlap.reshard_after_forward``: "auto" within ``prefetch_bytes`` and, on the CPU, the
host's room, "never" all of them, "always" none). Every setting trains as plain PyTorch does; what is kept is bounded as the setting says; a forward
whose backward never comes (a discarded loss, an evaluation in between) leaves nothing stale behind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import zinf
from dist_utils import run_distributed
from models import GPT, GPTConfig, batches, build, make_optimizer
from training import Recipe, reference, zinf_worker
from zinf.param.state import GroupState

pytestmark = pytest.mark.distributed

SETTINGS = ("auto", "always", "never")


def _recipe(setting: str, **overlap: int | str) -> Recipe:
    return Recipe(kind="gpt", steps=6, accum=2, zinf={"overlap": {"reshard_after_forward": setting, **overlap}})


RECIPES = {"auto": _recipe("auto"), "always": _recipe("always"), "never": _recipe("never"),
           "auto, a small window": _recipe("auto", prefetch_bytes=20_000, host_keep="off"),
           "auto, a small window and the host's room": _recipe("auto", prefetch_bytes=20_000),
           "auto, under max_gathered_bytes": _recipe("auto", max_gathered_bytes=80_000)}


def _run_all(rank: int, world: int) -> dict[str, dict]:
    return {name: zinf_worker(rank, world, recipe) for name, recipe in RECIPES.items()}


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_setting_trains_as_pytorch(world: int) -> None:
    results = run_distributed(_run_all, world)[0]
    for name, recipe in RECIPES.items():
        ref = torch.tensor(reference(recipe)[0], dtype=torch.float64)
        got = torch.tensor(results[name]["losses"], dtype=torch.float64)
        rel = ((got - ref).abs() / ref.abs()).max().item()
        assert rel < 1e-5, f"{name} on {world} ranks: {rel:.2e} from PyTorch"
        assert results[name]["rerecords"] == {"forward": 0, "backward": 0, "eval": 0}, name


def _kept(rank: int, world: int, setting: str, prefetch_bytes: int, host_keep: str = "off") -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"reshard_after_forward": setting, "host_keep": host_keep,
                                                    "prefetch_bytes": prefetch_bytes}})
    with zinf.Init(config):
        model = GPT(GPTConfig(n_layer=4))
    engine = zinf.initialize(model, make_optimizer(model), config)
    after_forward, gathers, kept = [], [], []
    for x, y in batches("gpt", 4, 8):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        after_forward.append(engine.fetcher.gathered_bytes)
        engine.backward(loss)
        engine.step()
        counts = engine.report().counts
        gathers.append(counts["prefetched_gathers"] + counts["demand_gathers"])
        kept.append(counts["kept_for_backward_bytes"])
        assert engine.fetcher.gathered_bytes == 0  # nothing is left gathered after a step
    total = sum(g.nbytes_full for g in engine.groups)
    # the groups gathered as the forward ends and first needed by the backward: the root's (its call spans the
    # forward) and the tied output layer's (the forward's last module)
    ends = {id(g): g.nbytes_full for m in (model, model.lm_head) for g in engine.hooks.keep.needed(m)}
    engine.close()
    return {"after_forward": after_forward, "gathers": gathers, "total": total, "ends": sum(ends.values()),
            "ends_count": len(ends), "kept": kept, "room": engine.hooks.keep.room}


def _kept_each(rank: int, world: int) -> list[dict]:
    return [_kept(rank, world, *how) for how in
            (("always", 64 << 20), ("auto", 64 << 20), ("auto", 30_000), ("never", 4096), ("auto", 1),
             ("auto", 1, "auto"), ("always", 1, "auto"))]


def test_what_stays_gathered_into_the_backward() -> None:
    always, auto, small, never, tiny, room, room_always = run_distributed(_kept_each, 2)[0]
    # the first step records the order: nothing is kept before both traces are known
    assert {r["after_forward"][0] for r in (always, auto, small, never, tiny)} == {0}
    # with no window at all, "auto" still keeps what the forward ends with and the backward starts with (whatever
    # its size: it is gathered then anyway): one all-gather fewer a step for each of those groups
    assert tiny["ends"] > 1 and tiny["after_forward"][1:] == [tiny["ends"]] * 3
    assert tiny["gathers"][1:] == [a - tiny["ends_count"] for a in always["gathers"][1:]]
    # "always": ZeRO-3 as DeepSpeed runs it; "never" keeps every group; "auto" keeps what fits prefetch_bytes
    assert always["after_forward"][1:] == [0, 0, 0]
    assert never["after_forward"][1:] == [never["total"]] * 3
    assert auto["after_forward"][1:] == [auto["total"]] * 3  # this model fits the default 64 MiB window whole
    assert all(0 < b <= 30_000 for b in small["after_forward"][1:]), small["after_forward"]
    # and the backward gathers only what was not kept: with everything kept, the forward's gathers alone
    assert auto["gathers"][1:] == never["gathers"][1:]
    assert all(n < s < a for n, s, a in zip(never["gathers"][1:], small["gathers"][1:], always["gathers"][1:])), (
        never["gathers"], small["gathers"], always["gathers"])
    # the step report counts what each backward found kept
    assert auto["kept"] == [0] + [auto["total"]] * 3 and always["kept"] == [0] * 4
    # [Note: keeping in the host's room]: on the CPU, "auto" keeps within host memory beside the window; this small
    # model fits any host's room whole, so the backward gathers nothing again however small the window
    assert room["room"] > room["total"] and tiny["room"] == 0 and room_always["room"] == 0
    assert room["after_forward"][1:] == [room["total"]] * 3 and room["kept"] == [0] + [room["total"]] * 3
    assert room["gathers"][1:] == never["gathers"][1:]
    assert room_always["gathers"] == always["gathers"]  # "always" keeps nothing, whatever the room


def _sequence(rank: int, world: int) -> list[float]:
    """Per step: a training forward whose loss is dropped (its backward never comes), a step without gradients,
    another such forward, an evaluation forward, then a forward, backward and step; the evaluation's losses are
    returned (they read the weights the steps made)."""
    torch.manual_seed(0)
    with zinf.Init():
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model))
    out = []
    for x, y in batches("gpt", 5, 8):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        engine(xs, ys)
        engine.step()  # no gradient since the last step: nothing changes (as in PyTorch), nothing kept survives it
        engine(xs, ys)
        with torch.no_grad():
            evaluation = engine(xs, ys).detach()
        engine.backward(engine(xs, ys))
        engine.step()
        dist.all_reduce(evaluation)
        out.append(evaluation.item() / world)
    engine.close()
    return out


def _sequence_reference() -> list[float]:
    torch.manual_seed(0)
    model = build("gpt")
    opt = make_optimizer(model)
    out = []
    for x, y in batches("gpt", 5, 8):
        opt.step()  # every gradient is None: nothing moves
        with torch.no_grad():
            out.append(model(x, y).item())
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_forward_without_its_backward_leaves_nothing_stale(world: int) -> None:
    got = torch.tensor(run_distributed(_sequence, world)[0], dtype=torch.float64)
    ref = torch.tensor(_sequence_reference(), dtype=torch.float64)
    rel = ((got - ref).abs() / ref.abs()).max().item()
    assert rel < 1e-5, (got, ref)


def _budget_and_loads(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"overlap": {"prefetch_bytes": 20_000, "host_keep": "off"}})
    with zinf.Init(config):
        model = build("gpt")
    engine = zinf.initialize(model, make_optimizer(model), config)
    data = batches("gpt", 3, 8)
    for x, y in data[:2]:  # both traces recorded
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
    x, y = data[2]
    engine(x.chunk(world)[rank], y.chunk(world)[rank])  # a training forward: its backward never comes
    fetcher = engine.fetcher
    kept = engine.hooks.keep.kept
    assert len(kept) >= 2 and fetcher.gathered_bytes == sum(g.nbytes_full for g in kept)
    # a module that needs one kept group and more than the cap leaves room for: the other kept groups are given
    # back, not the one it needs (that would gather it again on this rank alone, outside any round)
    largest = max((g for g in engine.groups if g.state is GroupState.SHARDED), key=lambda g: g.nbytes_full)
    needed = [kept[0], largest]
    fetcher.config = dataclasses.replace(fetcher.config,
                                         max_gathered_bytes=fetcher.gathered_bytes + largest.nbytes_full - 1)
    fetcher.acquire(needed, "test")
    assert [g.state for g in needed] == [GroupState.GATHERED] * 2 and kept[0].backward_held
    assert all(g.state is GroupState.SHARDED for g in kept[1:])
    assert fetcher.gathered_bytes == kept[0].nbytes_full + largest.nbytes_full
    fetcher.release(needed)
    engine.hooks.keep.drop()
    assert fetcher.gathered_bytes == 0 and all(g.state is GroupState.SHARDED for g in engine.groups)
    fetcher.config = config.overlap
    # another training forward keeps groups again; a load then replaces every value, kept ones too
    engine(x.chunk(world)[rank], y.chunk(world)[rank])
    assert engine.hooks.keep.kept
    torch.manual_seed(5)
    other = build("gpt").state_dict()
    engine.load_full_state_dict(other)
    with engine.gathered_parameters():  # read before any pass: a kept group would still show the old values
        stale = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), other[n])]
    assert not stale, stale
    with torch.no_grad():
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank]).detach()
    dist.all_reduce(loss)
    engine.close()
    return {"loss": loss.item() / world}


@pytest.mark.parametrize("world", [2])
def test_the_budget_and_loads_see_kept_groups(world: int) -> None:
    got = run_distributed(_budget_and_loads, world)[0]["loss"]
    torch.manual_seed(5)
    model = build("gpt")
    x, y = batches("gpt", 3, 8)[2]
    with torch.no_grad():
        want = model(x, y).item()
    assert abs(got - want) / want < 1e-5, (got, want)
