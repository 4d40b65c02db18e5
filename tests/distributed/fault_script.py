"""A run in which rank 1 ends abnormally inside a zinf call, under torchrun, for test_clean_exit.py:

    torchrun --nproc_per_node 2 fault_script.py {segv-backward,abort-thread-step,raise-forward}

- ``segv-backward``: a bad memory access in the main thread during the backward of step 2;
- ``abort-thread-step``: ``abort()`` in a thread of the optimizer (as a C++ ``std::terminate`` in a worker thread
  would) during the optimizer step of step 2;
- ``raise-forward``: an exception nobody catches, raised in a module's forward of step 2.

Rank 0 runs the same steps and is stopped by the launcher when rank 1 is gone.
"""

import ctypes
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

import zinf

MODE = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"step": 0}


def doomed() -> bool:
    return rank == 1 and state["step"] == 2


class BadAccess(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        if MODE == "segv-backward" and doomed():
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if MODE == "raise-forward" and doomed():
            raise RuntimeError("a shape this block cannot take")
        return BadAccess.apply(self.linear(x))


class AbortingSGD(torch.optim.SGD):
    def step(self, closure=None):  # noqa: ANN001, ANN201
        if MODE == "abort-thread-step" and doomed():
            worker = threading.Thread(target=os.abort, name="optimizer-worker")
            worker.start()
            worker.join()
        return super().step(closure)


model = nn.Sequential(Block(), Block())
engine = zinf.initialize(model, AbortingSGD(model.parameters(), lr=0.1))
for step in range(1, 4):
    state["step"] = step
    loss = engine(torch.randn(4, 16)).square().mean()
    engine.backward(loss)
    engine.step()
print(f"rank {rank} finished", flush=True)
