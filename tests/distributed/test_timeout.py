"""A stopped peer does not block the others silently: with collective_timeout_s the survivors stop with an
error that names the rank that stopped answering (2 gloo ranks, rank 1 SIGSTOPs itself)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zinf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _entry(rank: int, world: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    with open(f"{tmp}/pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"collective_timeout_s": 3})
    start = time.monotonic()
    try:
        for step in range(50):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGSTOP)  # a peer stopped by a debugger or the scheduler
            engine.backward(engine(torch.randn(4, 16)).square().mean())
            engine.step()
            start = time.monotonic()
        result = "no error"
    except zinf.CollectiveTimeoutError as exc:
        result = f"{time.monotonic() - start:.1f}s|{exc}"
    except Exception:  # noqa: BLE001
        result = "other|" + traceback.format_exc()
    with open(f"{tmp}/result{rank}", "w") as f:
        f.write(result)
    if rank == 0:
        with open(f"{tmp}/pid1") as f:
            os.kill(int(f.read()), signal.SIGKILL)
    os._exit(0)


def test_a_stopped_peer_is_named_within_the_timeout() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(Exception):  # noqa: B017 - rank 1 ends killed, which start_processes reports
            mp.start_processes(_entry, args=(2, tmp), nprocs=2, start_method="spawn")
        result = open(f"{tmp}/result0").read()
    waited, _, message = result.partition("|")
    assert "rank(s) 1 did not answer" in message, result
    assert "collective_timeout_s" in message and "rank 0:" in message
    assert float(waited.rstrip("s")) < 30, result  # the timeout, plus the few seconds spent asking
