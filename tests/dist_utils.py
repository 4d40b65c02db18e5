"""Run a function on N real processes joined by a gloo process group, and collect what each returns.

The ranks are forked from a forkserver that imported torch, zinf, transformers and the tests' helpers once,
so a run does not pay each rank's imports again (about 3 s of every spawn on a 2-core machine, ~100 runs in
the suite). Each rank is still a new process with nothing run in it before: the server only imports (no
tensor op, no thread pool started, no process group). Where the environment differs from the one the server
started with, the first run's (a test that sets a variable read at process start, such as
``MALLOC_MMAP_THRESHOLD_``; the forked ranks would inherit the server's instead), with
NCCL, and where a test asks (``fresh=True``: memory measured per rank), the ranks are spawned as fresh
interpreters instead. The ranks' stdout/stderr are the server's, i.e. those of the test that started it: a
rank's error reaches the test through its result file, as before.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import processes

# what the forkserver imports once (multiprocessing's forkserver skips a module it cannot import)
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "zinf", "transformers", "dist_utils", "models",
            "training", "patterns", "processes"]
PER_TEST_ENV = {"PYTEST_CURRENT_TEST"}  # set by pytest around each test: not a setting the ranks read
_server_env: dict[str, str] | None = None  # the environment the forkserver started with (its ranks inherit it)


def _start_method(backend: str, fresh: bool) -> str:
    global _server_env
    if fresh or backend != "gloo":
        return "spawn"  # NCCL: a fresh interpreter per rank, whatever the preloaded imports did
    env = {k: v for k, v in os.environ.items() if k not in PER_TEST_ENV}
    if _server_env is None:  # the first run starts the server, with this environment
        import multiprocessing

        multiprocessing.set_forkserver_preload(_PRELOAD)
        _server_env = env
    return "forkserver" if env == _server_env else "spawn"


def _entry(rank: int, world: int, outdir: str, fn: Callable[..., Any], args: tuple, backend: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":  # pragma: no cover - GPU machines only
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # rendezvous through a file of this run: a port picked here and bound later can be taken in between
    dist.init_process_group(backend, init_method=f"file://{os.path.join(outdir, 'rendezvous')}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()
    # The result is saved. Leave without interpreter finalization: in torch 2.13 gloo's worker threads can
    # still hold finished work objects whose tensors are then freed without the GIL, which aborts the
    # process ("terminate called without an active exception") after a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                    fresh: bool = False) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results (raises on any failure).
    ``fresh``: new interpreters, not forks of the server (a rank's own memory is then its own, not pages it shares
    with the server until it writes them)."""
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(_entry, args=(world, outdir, fn, args, backend), nprocs=world,
                                     start_method=_start_method(backend, fresh), join=False)
        pids = [p.pid for p in context.processes]
        processes.register(pids)
        try:
            while not context.join():
                pass
        except Exception as exc:
            errors = []
            for r in range(world):
                path = os.path.join(outdir, f"rank{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"rank {r}:\n{rec['error']}")
            raise AssertionError("distributed run failed:\n" + "\n".join(errors or [str(exc)])) from None
        finally:  # [Note: reaping] in tests/processes.py: a failure, timeout or Ctrl-C leaves no worker behind
            processes.kill_pids(p.pid for p in context.processes if p.is_alive())
            for p in context.processes:
                p.join(timeout=30)
            processes.unregister(pids)
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)["result"] for r in range(world)]


def exit_cleanly() -> None:
    """End a driver script: wait for every rank (their records are written), leave the process group, and
    exit without interpreter finalization, where torch 2.13's gloo threads can abort a finished run
    ("terminate called without an active exception"; see docs/known_issues.md)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
