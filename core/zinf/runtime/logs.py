"""Logging by rank (the ``zinf`` loggers speak on rank 0 only, unless every rank is asked to), and the names that
profiler traces and debug logs share: :func:`label` builds ``zinf::<kind>(<module>)`` (e.g.
``zinf::all_gather(layers.3)``), and :func:`region` opens ``torch.profiler.record_function`` with it and logs it at
DEBUG, so a trace and a debug log name the same work alike."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Literal

import torch
import torch.distributed as dist

__all__ = ["KINDS", "Kind", "RankFilter", "current_rank", "install_rank_filter", "label", "log_all_ranks", "region"]

log = logging.getLogger(__name__)

_ALL_RANKS_ENV = "ZINF_LOG_ALL_RANKS"
_all_ranks_override: bool | None = None


def log_all_ranks(enabled: bool | None = True) -> None:
    """Let every rank's ``zinf`` records through (True), rank 0's only (False), or follow the
    environment variable ``ZINF_LOG_ALL_RANKS=1`` again (None, the default state)."""
    global _all_ranks_override
    _all_ranks_override = enabled


def _all_ranks() -> bool:
    if _all_ranks_override is not None:
        return _all_ranks_override
    return os.environ.get(_ALL_RANKS_ENV, "") == "1"


def current_rank() -> int:
    """The global rank: torch.distributed's once initialised, else the launcher's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class RankFilter(logging.Filter):
    """Passes info and debug records on rank 0 only, unless all ranks log (``all_ranks``, else
    :func:`log_all_ranks`, else ``ZINF_LOG_ALL_RANKS=1``); warnings and errors pass on every rank. Records from
    other ranks are prefixed ``[rank N]``. The rank
    is also set on the record as ``zinf_rank`` for formatters."""

    def __init__(self, all_ranks: bool | None = None) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        if rank == 0:
            record.zinf_rank = 0
            return True
        if record.levelno < logging.WARNING and not (_all_ranks() if self.all_ranks is None else self.all_ranks):
            return False  # warnings and errors pass on every rank: a timeout or a failed step is rank-specific
        if getattr(record, "zinf_rank", None) is None:  # prefix once, whatever else filters the record
            record.msg = f"[rank {rank}] {record.msg}"
        record.zinf_rank = rank
        return True


def install_rank_filter(logger_name: str = "zinf") -> RankFilter:
    """Put one :class:`RankFilter` on ``logger_name`` and on every logger below it that exists now.

    A filter on a logger is not consulted for records of its child loggers (``zinf.schedule.fetcher``),
    hence the walk over existing descendants; call again after importing more modules. Idempotent:
    loggers that already carry a RankFilter keep it, and that filter is returned.
    """
    root = logging.getLogger(logger_name)
    found = next((f for f in root.filters if isinstance(f, RankFilter)), None)
    shared = found or RankFilter()
    prefix = logger_name + "."
    loggers = [root] + [lg for name, lg in list(logging.Logger.manager.loggerDict.items())
                        if name.startswith(prefix) and isinstance(lg, logging.Logger)]
    for lg in loggers:
        if not any(isinstance(f, RankFilter) for f in lg.filters):
            lg.addFilter(shared)
    return shared


Kind = Literal["h2d", "all_gather", "reduce_scatter", "d2h", "nvme_read", "nvme_write", "optimizer",
               "broadcast_buffers"]
KINDS: tuple[str, ...] = ("h2d", "all_gather", "reduce_scatter", "d2h", "nvme_read", "nvme_write", "optimizer",
                          "broadcast_buffers")


def label(kind: Kind, name: str) -> str:
    """``zinf::<kind>(<name>)``, ``name`` being the module's qualified name, e.g. ``zinf::h2d(layers.3)``."""
    if kind not in KINDS:
        raise ValueError(f"zinf: unknown region kind {kind!r}; expected one of {', '.join(KINDS)}")
    return f"zinf::{kind}({name})"


@contextlib.contextmanager
def region(kind: Kind, name: str) -> Iterator[str]:
    """A profiler range named :func:`label` ``(kind, name)``; the same label is logged when ``zinf`` is at DEBUG."""
    text = label(kind, name)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", text)
    if not torch._C._autograd._profiler_enabled():  # no profiler running: a range would cost ~20 us for nothing
        yield text
        return
    with torch.profiler.record_function(text):
        yield text

