"""The rank-0 log filter (info on rank 0 only, warnings and errors from every rank, prefixed with the rank), and the
region labels that profiler traces and debug logs share."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import zinf.runtime.logs as logs_mod
from zinf.runtime.logs import KINDS, RankFilter, install_rank_filter, label, log_all_ranks, region


@pytest.fixture()
def rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The rank the filter sees, settable by the test (torch.distributed is not initialised here)."""
    box = [0]
    monkeypatch.setattr(logs_mod, "current_rank", lambda: box[0])
    monkeypatch.delenv("ZINF_LOG_ALL_RANKS", raising=False)
    log_all_ranks(None)
    yield box
    log_all_ranks(None)


def _record(msg: str = "gathered %d groups", args: tuple = (3,)) -> logging.LogRecord:
    return logging.LogRecord("zinf.fetch", logging.INFO, __file__, 1, msg, args, None)


def test_rank_filter_passes_rank_zero_only(rank: list[int]) -> None:
    f = RankFilter()
    rec = _record()
    assert f.filter(rec) and rec.getMessage() == "gathered 3 groups"
    rank[0] = 3
    assert not f.filter(_record())


def test_rank_filter_passes_warnings_and_errors_on_every_rank(rank: list[int]) -> None:
    rank[0] = 1
    rec = logging.LogRecord("zinf.fetch", logging.ERROR, __file__, 1, "the background step failed", (), None)
    assert RankFilter().filter(rec) and rec.getMessage() == "[rank 1] the background step failed"


def test_rank_filter_all_ranks_by_env_function_or_argument(rank: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    rank[0] = 2
    monkeypatch.setenv("ZINF_LOG_ALL_RANKS", "1")
    rec = _record()
    assert RankFilter().filter(rec)
    assert rec.getMessage() == "[rank 2] gathered 3 groups" and rec.zinf_rank == 2
    assert RankFilter().filter(rec) and rec.getMessage() == "[rank 2] gathered 3 groups"  # prefixed once
    assert not RankFilter(all_ranks=False).filter(_record())  # an explicit argument wins over the env
    log_all_ranks(False)  # and the function over the env
    assert not RankFilter().filter(_record())
    monkeypatch.delenv("ZINF_LOG_ALL_RANKS")
    log_all_ranks(True)
    assert RankFilter().filter(_record())
    log_all_ranks(None)  # back to the env, which is unset now
    assert not RankFilter().filter(_record())
    assert RankFilter(all_ranks=True).filter(_record())


def test_current_rank_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # another test may have left one up
    monkeypatch.delenv("RANK", raising=False)
    assert logs_mod.current_rank() == 0
    monkeypatch.setenv("RANK", "5")  # set by torchrun before the process group exists
    assert logs_mod.current_rank() == 5


def test_install_rank_filter_covers_child_loggers_once(rank: list[int], caplog: pytest.LogCaptureFixture) -> None:
    name = "zinf_test_streams_logs"
    parent, child = logging.getLogger(name), logging.getLogger(name + ".fetch.gather")
    try:
        first = install_rank_filter(name)
        assert install_rank_filter(name) is first
        for lg in (parent, child):
            assert [f for f in lg.filters if isinstance(f, RankFilter)] == [first]
        caplog.set_level(logging.INFO, logger=name)
        child.info("on rank zero")
        rank[0] = 1
        child.info("on rank one")
        log_all_ranks(True)
        parent.info("everyone")
        assert [r.getMessage() for r in caplog.records] == ["on rank zero", "[rank 1] everyone"]
    finally:
        for lg in (parent, child):
            for f in [f for f in lg.filters if isinstance(f, RankFilter)]:
                lg.removeFilter(f)


# ---- labels and regions --------------------------------------------------------------------------------

def test_labels() -> None:
    assert label("h2d", "layers.3") == "zinf::h2d(layers.3)"
    assert label("all_gather", "layers.3") == "zinf::all_gather(layers.3)"
    assert [label(k, "m") for k in KINDS] == [
        "zinf::h2d(m)", "zinf::all_gather(m)", "zinf::reduce_scatter(m)", "zinf::d2h(m)",
        "zinf::nvme_read(m)", "zinf::nvme_write(m)", "zinf::optimizer(m)", "zinf::broadcast_buffers(m)"]
    with pytest.raises(ValueError, match="unknown region kind 'allgather'.*all_gather"):
        label("allgather", "m")  # type: ignore[arg-type]


def test_region_logs_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zinf")
    with region("h2d", "layers.3"):
        pass
    assert not [r for r in caplog.records if r.name.startswith("zinf")]
    caplog.set_level(logging.DEBUG, logger="zinf")
    with region("reduce_scatter", "layers.3.attn") as text:
        assert text == "zinf::reduce_scatter(layers.3.attn)"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("zinf")] == [text]


def test_region_names_the_profiler_event_as_the_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="zinf")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with region("all_gather", "x"):
            torch.ones(4).add_(1)
    names = {e.name for e in prof.events()}
    assert "zinf::all_gather(x)" in names
    assert "zinf::all_gather(x)" in [r.getMessage() for r in caplog.records]
