"""Glue to third-party model libraries (transformers), each in a module of its own that imports the library only
when it is used.

[Note: integrations are activated, not imported]
Importing zinf patches no other library: no finder is added to ``sys.meta_path`` and no class of another library
is touched. The glue is turned on for the whole process by :func:`activate`, which the things that need it call:

- entering ``zinf.Init`` (so a ``from_pretrained`` inside it, the user's own block or a front end's, builds a
  partitioned model: integrations/transformers.py);
- building a ``ZeroInfinityEngine`` (``zinf.initialize``, the Accelerate and Lightning front ends), so that
  transformers' ``Trainer`` saves and resumes the model it trains (integrations/trainer.py);
- ``zinf launch``, on every rank before the user's script runs (accelerate_zinf/run.py).

Each integration module registers its ``watch`` here when it is imported (``zinf/__init__`` imports them); this
module imports none of them, so the parts of zinf that call :func:`activate` do not depend on them. ``activate``
calls every registered ``watch`` once per process; a ``watch`` wraps the library's classes at once if the library is
loaded, else adds an import hook that wraps them as soon as it is. Every wrapper defers to the library's own code
unless zinf is in use (a zinf load, a zinf engine, a launcher), so activating changes nothing for anything else.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["activate", "active", "register"]

_watches: list[Callable[[], object]] = []
_state = {"active": False}
_lock = threading.RLock()


def register(watch: Callable[[], object]) -> None:
    """Have :func:`activate` call ``watch`` (an integration module's, registered when the module is imported); called
    at once when the integrations are active already."""
    with _lock:
        _watches.append(watch)
        if _state["active"]:
            watch()


def activate() -> None:
    """Turn zinf's integrations with other libraries on in this process (idempotent; see [Note: integrations are
    activated, not imported]). ``zinf.Init``, the engine and ``zinf launch`` call it, each before anything it
    starts can need the wrappers, so a script does not call it itself."""
    with _lock:
        if _state["active"]:
            return
        _state["active"] = True
        for watch in list(_watches):
            watch()


def active() -> bool:
    """Whether :func:`activate` has run in this process."""
    return _state["active"]
