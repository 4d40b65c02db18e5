"""What the front-end scripts that call ``from_pretrained`` report about the load, for the tests to check:

- ``resident_share(model)``: this rank's parameter bytes in memory over the whole model's (about 1/world when the
  model came out of ``from_pretrained`` partitioned, 1 for a whole model);
- ``LoadLog``: zinf's "loaded N tensors ... this rank read X of the files' Y" line (the streaming loader ran), with
  X and Y in bytes.

Imported by scripts in this folder (their folder is on ``sys.path`` when they run).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

__all__ = ["resident_share", "LoadLog"]

_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_LOADED = re.compile(r"zinf: loaded (\d+) tensors .*: this rank read ([\d.]+ \w+) of the files' ([\d.]+ \w+)")


def resident_share(model: nn.Module) -> float:
    """Bytes held by the storages behind the model's parameters and zinf's shards of them (each storage once),
    over the bytes of the whole model's parameters."""
    from zinf.param.registry import groups_of

    storages: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is not None:
            s = t.untyped_storage()
            storages[id(s) if s.data_ptr() == 0 else s.data_ptr()] = s.nbytes()

    params = list(model.parameters())
    for p in params:
        add(p.data)
    for g in groups_of(params):
        for t in (g.shard, g.master, g.full):
            add(t)
    return sum(storages.values()) / sum(p.numel() * p.element_size() for p in params)


def _bytes(text: str) -> int:
    value, unit = text.split()
    return round(float(value) * _UNITS[unit])


class LoadLog(logging.Handler):
    """Collects zinf's per-load summary lines on this rank (from now on, until ``close``)."""

    _LOGGER = "zinf.checkpoint.pretrained"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.loads: list[dict[str, int]] = []
        logger = logging.getLogger(self._LOGGER)
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        m = _LOADED.match(record.getMessage())
        if m:
            self.loads.append({"tensors": int(m[1]), "read_bytes": _bytes(m[2]), "file_bytes": _bytes(m[3])})

    def close(self) -> None:
        logging.getLogger(self._LOGGER).removeHandler(self)
        super().close()
