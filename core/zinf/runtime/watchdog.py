"""Collective timeouts that say which rank stopped answering.

[Note: collective timeout]
With ``collective_timeout_s`` > 0 the engine sets that timeout on its process group (torch's
``_set_pg_timeout``; the launcher's own timeout otherwise applies: 30 minutes for gloo, 10 for NCCL). A
collective that waits longer fails in torch with a message that names no rank. The engine turns that
failure into a :class:`~zinf.errors.CollectiveTimeoutError`: every rank that timed out writes "I am here"
into the process group's key-value store (the rendezvous store, which needs no collective), waits a few
seconds for the others' entries, and names the ranks that wrote none: stopped (SIGSTOP, a debugger), hung
in their own code, or dead. Ranks that timed out too are listed as such.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from zinf.errors import CollectiveTimeoutError, SharedMemoryTimeout, ZinfError
from zinf.runtime.comm import Comm

__all__ = ["CollectiveWatchdog"]

log = logging.getLogger(__name__)

def _is_timeout(exc: BaseException) -> bool:
    """A collective's timeout as torch's backends report it: gloo raises a RuntimeError from its transport
    ("gloo/transport/... Timed out waiting 3000ms for recv operation to complete"), NCCL a DistBackendError.
    Anything else that merely mentions a timeout (user code, a data loader) is left as it is. The shared memory of
    ranks on one host raises its own :class:`SharedMemoryTimeout`."""
    if isinstance(exc, SharedMemoryTimeout):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, ZinfError):
        return False
    text = str(exc).lower()
    timed_out = "timed out" in text or "timeout" in text
    backend_error = getattr(dist, "DistBackendError", None)
    if timed_out and ("gloo" in text or "nccl" in text or "pair closure" in text
                      or (backend_error is not None and isinstance(exc, backend_error))):
        return True
    # a collective that fails while the engine unwinds from a timeout (telling the other ranks it stopped)
    inner = exc.__cause__ or exc.__context__
    return inner is not None and inner is not exc and _is_timeout(inner)


class CollectiveWatchdog:
    def __init__(self, comm: Comm, timeout_s: float) -> None:
        self.comm = comm
        self.timeout_s = timeout_s
        self.active = timeout_s > 0 and comm.world > 1 and dist.is_available() and dist.is_initialized()
        self._events = 0
        if self.active:
            try:
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), comm.group)
            except Exception as exc:  # noqa: BLE001 - a torch without it: say so, keep the launcher's timeout
                log.warning("zinf: collective_timeout_s=%s could not be applied (%s); the launcher's timeout applies",
                            timeout_s, exc)
                self.active = False

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Run ``what`` (forward, backward, step); a collective timeout inside becomes a CollectiveTimeoutError."""
        try:
            yield
        except RuntimeError as exc:
            if not self.active or not _is_timeout(exc):
                raise
            raise CollectiveTimeoutError(self._diagnose(what)) from exc

    def _diagnose(self, what: str) -> str:
        self._events += 1
        rank, world = self.comm.rank, self.comm.world
        head = (f"zinf: rank {rank}: a collective during {what} waited {self.timeout_s:g} s "
                f"(collective_timeout_s) for the other ranks and gave up")
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            return head + "; the process group has no store to ask which rank is missing. Check every rank's process."
        prefix = f"zinf/timeout/{self._events}/"
        store.set(prefix + str(rank), "1")
        deadline = time.monotonic() + min(10.0, max(2.0, self.timeout_s))
        others = [r for r in range(world) if r != rank]
        answered: set[int] = set()
        while time.monotonic() < deadline and len(answered) < len(others):
            for r in others:
                if r not in answered and store.check([prefix + str(r)]):
                    answered.add(r)
            time.sleep(0.1)
        silent = [r for r in others if r not in answered]
        if not silent:
            return (head + f"; every other rank ({', '.join(map(str, others))}) timed out too, so none is stuck "
                    "alone: a collective order that differs between ranks, or a network problem.")
        return (head + f"; rank(s) {', '.join(map(str, silent))} did not answer (stopped, hung in its own code, or "
                "dead: look at that process)" + (f"; rank(s) {', '.join(map(str, sorted(answered)))} timed out "
                                                  "waiting too" if answered else "") + ".")
