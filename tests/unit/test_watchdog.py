"""Which errors the collective watchdog turns into CollectiveTimeoutError: the backends' timeouts only."""

from __future__ import annotations

from zinf.errors import SharedMemoryTimeout, ZinfError
from zinf.runtime.watchdog import _is_timeout


def test_only_backend_timeouts_count() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms "
                        "for recv operation to complete")
    assert _is_timeout(gloo)
    assert not _is_timeout(RuntimeError("DataLoader timed out after 5 seconds"))
    assert not _is_timeout(RuntimeError("my model's forward has a timeout"))
    assert not _is_timeout(ValueError("gloo timed out"))
    assert _is_timeout(SharedMemoryTimeout("zinf: timed out after 3s waiting for rank 1 in a shared-memory collective"))
    assert not _is_timeout(ZinfError("zinf: timed out reading a checkpoint"))
