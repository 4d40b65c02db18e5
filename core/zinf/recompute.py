"""Activation checkpointing for partitioned models, with the saved block inputs optionally in host memory.

[Note: recomputation]
``activation_checkpointing.modules`` names blocks (class names or qualified-name patterns). Each such
block's forward runs through torch's non-reentrant ``checkpoint``: autograd keeps none of the block's
intermediate tensors, only its inputs, and the block runs again when backward reaches it. The inputs
are held by a :class:`HeldInputs` object that the checkpoint passes to the recomputation instead of the
tensors themselves: the first run uses the live tensors (so gradients flow to them), later runs get
detached copies with the same ``requires_grad``. With ``offload: true`` the held copy lives in host
memory (pinned and copied on a side stream with CUDA, waited for by an event before the copy back),
and the live tensors are dropped once the first run has used them, so the device holds nothing of the
block between forward and backward. The device tensors a side-stream copy reads are kept alive by its
:class:`~zinf.runtime.streams.BufferFence` until compute has waited for the copy, at the end of the first
run (see [Note: streams] in zinf/runtime/streams.py; no ``record_stream``).

The recomputation does not go through the block's ``__call__``, so the block's own parameters (if it
holds any directly) are gathered around it by ``ModuleHooks.recompute_scope``; its submodules' hooks
gather theirs as in forward. Those gathers are recorded in the backward trace in the order backward
runs them (see [Note: balanced hooks] in zinf/schedule/hooks.py), so from the second step on they are
prefetched like every other backward gather.

[Note: recomputation in compiled blocks]
A checkpointed block that ``torch.compile`` traces (the block compiled, or a model compiled around it) takes torch's
own ``checkpoint`` of its forward with the live inputs instead: dynamo turns it into a checkpointed region of the
graph, whose backward recomputes the block from the inputs the graph saved. The recomputation runs inside the
block's compiled backward, after the block's backward hook gathered its groups (as for any compiled block), so it
needs no ``recompute_scope``. Holding the inputs in host memory (``offload: true``) is not something a graph can
do, so that setting is refused at the first compiled call; the inputs such a graph saves are not in
``held_bytes``.
"""

from __future__ import annotations

import fnmatch
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from zinf.config_sections import CheckpointingConfig
from zinf.errors import UnsupportedModelError
from zinf.runtime.streams import BufferFence
from zinf.schedule.not_traced import not_traced

if TYPE_CHECKING:
    from zinf.schedule.hooks import ModuleHooks

__all__ = ["ActivationCheckpointing", "HeldInputs", "ActivationMeter"]

log = logging.getLogger(__name__)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _unique_nbytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class HeldInputs:
    """A checkpointed block's inputs between forward and backward (see [Note: recomputation])."""

    def __init__(self, args: tuple, kwargs: dict, offload: bool, side_stream: Any = None) -> None:
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.tensor_at = [i for i, v in enumerate(self.leaves) if isinstance(v, torch.Tensor)]
        self.live: list[Any] | None = list(self.leaves)
        self.requires_grad = {i: self.leaves[i].requires_grad for i in self.tensor_at}
        self.devices = {i: self.leaves[i].device for i in self.tensor_at}
        self.fence: BufferFence | None = None  # the copies to host memory, with CUDA
        if offload:
            self.held = list(self.leaves)
            for i in self.tensor_at:
                self.held[i] = self._to_host(self.leaves[i], side_stream)
            on_device = [self.leaves[i].detach() for i in self.tensor_at if self.leaves[i].is_cuda]
            if on_device:  # pragma: no cover - CUDA only
                # one event after every copy (they run in order on the side stream); the device tensors they
                # read stay referenced until compute has waited for it (``copied``)
                self.fence = BufferFence(torch.cuda.Event()).record(side_stream, *on_device)
            self.tier = "cpu"
        else:
            self.held = [v.detach() if isinstance(v, torch.Tensor) else v for v in self.leaves]
            self.tier = tier_of_device(self.leaves[self.tensor_at[0]].device) if self.tensor_at else "cpu"
        self.leaves = []  # only `live` (first run) and `held` (recomputation) keep tensors
        self.nbytes = _unique_nbytes([self.held[i] for i in self.tensor_at])

    def _to_host(self, t: torch.Tensor, side_stream: Any) -> torch.Tensor:
        if t.device.type != "cuda":  # CPU compute: a separate host buffer, so what is held is measured alike
            return t.detach().clone()
        # CUDA path: written for GPUs, not yet run on one (this project's CI has none)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # pragma: no cover
        side_stream.wait_stream(torch.cuda.current_stream(t.device))  # pragma: no cover
        with torch.cuda.stream(side_stream):  # pragma: no cover
            host.copy_(t.detach(), non_blocking=True)
        return host  # pragma: no cover

    def copied(self) -> None:
        """The first run is over: compute waits (on the device) for the copies to host memory, then the device
        tensors they read are no longer held here, so their memory is reused only after the copies."""
        if self.fence is not None:  # pragma: no cover - CUDA only
            self.fence.make_wait(torch.cuda.current_stream())
            self.fence.release()

    def take(self) -> tuple[tuple, dict]:
        """The inputs for this run of the block: the live ones the first time, restored copies after."""
        if self.live is not None:
            leaves, self.live = self.live, None
            return tree_unflatten(leaves, self.spec)
        if self.fence is not None:  # pragma: no cover - CUDA only: the copy back reads the host copy once written
            self.fence.make_wait(torch.cuda.current_stream())
            self.fence.release()
        leaves = list(self.held)
        for i in self.tensor_at:
            t = self.held[i].to(self.devices[i], non_blocking=True).detach()
            leaves[i] = t.requires_grad_(self.requires_grad[i]) if t.is_floating_point() or t.is_complex() else t
        return tree_unflatten(leaves, self.spec)


def _refuse_held_in_host(name: str) -> None:
    raise UnsupportedModelError(
        f"zinf: {name} is checkpointed with activation_checkpointing.offload: true and compiled by torch.compile; a "
        "compiled graph keeps the inputs it saves, so they cannot be held in host memory. Set "
        "activation_checkpointing.offload: false, or leave the checkpointed blocks uncompiled.")


def tier_of_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "device"


class ActivationCheckpointing:
    """Checkpoints the configured blocks of ``model`` (see [Note: recomputation]); ``remove()`` undoes it."""

    def __init__(self, model: nn.Module, config: CheckpointingConfig, hooks: "ModuleHooks") -> None:
        self.config = config
        self.hooks = hooks
        self.held_bytes: dict[str, int] = {}
        self.peak_held_bytes: dict[str, int] = {}
        self._side_stream: Any = None
        self.blocks: dict[nn.Module, str] = {}
        # raised eagerly, not traced: an error the user reads, not one of dynamo's
        self._refuse_held_in_host = not_traced(_refuse_held_in_host, "zinf refuses this setting for compiled blocks")
        for name, module in model.named_modules():
            if module is model and config.modules and any(type(module).__name__ == p or fnmatch.fnmatchcase(name, p)
                                                          for p in config.modules):
                raise UnsupportedModelError("zinf config: activation_checkpointing.modules matches the root model; "
                                            "name the blocks inside it (e.g. their class name).")
            if any(type(module).__name__ == p or fnmatch.fnmatchcase(name, p) for p in config.modules):
                if any(anc in self.blocks for anc in self._ancestors(model, name)):
                    continue  # inside a checkpointed block: recomputed with it already
                self.blocks[module] = name
        if config.modules and not self.blocks:
            raise UnsupportedModelError(
                f"zinf config: activation_checkpointing.modules={list(config.modules)} matches no module of the model; "
                "name block classes (e.g. 'Block', 'LlamaDecoderLayer') or qualified-name patterns ('blocks.*').")
        for module in self.blocks:
            if "forward" in module.__dict__:
                raise UnsupportedModelError(f"zinf: {self.blocks[module]} has a forward set on the instance already "
                                            "(another wrapper); checkpoint it with one mechanism only.")
            module.forward = self._wrap(module, module.forward)  # type: ignore[method-assign]
        if self.blocks:
            log.info("zinf: checkpointing %d blocks%s", len(self.blocks), " (inputs in host memory)" if config.offload else "")

    @staticmethod
    def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
        parts = name.split(".") if name else []
        return [model.get_submodule(".".join(parts[:k])) for k in range(1, len(parts))]

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self.hooks

        def run(held: HeldInputs, *device_marker: torch.Tensor) -> Any:
            args, kwargs = held.take()
            if _in_backward():  # the recomputation skips the block's own __call__ and its hooks
                with hooks.recompute_scope(module):
                    return forward(*args, **kwargs)
            out = forward(*args, **kwargs)
            held.copied()  # the copies to host memory ran beside the block's forward
            return out

        def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
            # traced by dynamo: see [Note: recomputation in compiled blocks]
            if torch.compiler.is_compiling():
                if not torch.is_grad_enabled():
                    return forward(*args, **kwargs)
                if self.config.offload:
                    self._refuse_held_in_host(self.blocks[module])
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            if not torch.is_grad_enabled() or _in_backward():  # evaluation, or inside an enclosing recomputation
                return forward(*args, **kwargs)
            held = HeldInputs(args, kwargs, self.config.offload, self._stream(args, kwargs))
            self._count(held)
            # checkpoint finds the devices whose random state it must replay from its tensor arguments; the
            # inputs travel inside `held`, so an empty tensor on their device stands in for them
            marker = [torch.empty(0, device=d) for d in {d for d in held.devices.values() if d.type != "cpu"}]
            return checkpoint(run, held, *marker, use_reentrant=False)

        return checkpointed_forward

    def _stream(self, args: tuple, kwargs: dict) -> Any:
        if not self.config.offload or not torch.cuda.is_available():
            return None
        if self._side_stream is None:  # pragma: no cover - CUDA only
            self._side_stream = torch.cuda.Stream()
        return self._side_stream  # pragma: no cover

    def _count(self, held: HeldInputs) -> None:
        tier, n = held.tier, held.nbytes
        self.held_bytes[tier] = self.held_bytes.get(tier, 0) + n
        self.peak_held_bytes[tier] = max(self.peak_held_bytes.get(tier, 0), self.held_bytes[tier])
        weakref.finalize(held, self._uncount, tier, n)

    def _uncount(self, tier: str, n: int) -> None:
        self.held_bytes[tier] -= n

    def remove(self) -> None:
        for module in self.blocks:  # the blocks stay listed: what was checkpointed
            module.__dict__.pop("forward", None)


class ActivationMeter:
    """``with ActivationMeter() as m: loss = model(x)`` -- the bytes autograd saved for backward during the
    block, by tier ("device" / "cpu"), counting each storage once and leaving out parameters (zinf gathers
    and releases those). Tensors saved inside checkpointed blocks are not held, so they do not count; add
    ``ActivationCheckpointing.held_bytes`` for the block inputs a checkpoint keeps."""

    def __init__(self) -> None:
        self._storages: dict[int, tuple[str, int]] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            s = t.untyped_storage()
            self._storages[s.data_ptr()] = (tier_of_device(t.device), s.nbytes())
        return t

    @property
    def bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tier, n in self._storages.values():
            out[tier] = out.get(tier, 0) + n
        return out

    def __enter__(self) -> "ActivationMeter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
