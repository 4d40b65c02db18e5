"""Construction-time partitioning: build a model so that no rank ever holds all of it.

Inside ``with zinf.Init(...)``, each module's direct parameters are flattened and split across ranks
as soon as that module is attached to its parent (its own ``__init__``, with its own initialisation,
has finished by then). Parameters still unpartitioned when the block ends (the root's own ones) are
partitioned at exit. Initialisation that runs later and touches an already partitioned parameter (a
parent re-initialising a child's weight, ``module.weight.data.normal_()``, a ``post_init`` pass) is
seen by a torch function mode: the parameter's group is gathered, the operation runs on the full
tensor (consuming the random generator exactly as without zinf), and the result is written back to
the shards as soon as the next operation no longer touches it. Values agree across ranks: each module's values,
and each such edit, are rank 0's when ranks differ (seeded differently), as DDP does (see [Note: initial values
agree] in partition.py). With parameters on NVMe (``offload.params: nvme``) each module's shard goes straight to
a file there as soon as it is built (see [Note: construction spill] in zinf/offload/spill_store.py), so building a
model larger than host memory holds one module at a time. With ``tiling`` in the config, the
large ``nn.Linear`` layers of each model built in the block are tiled at exit, after all of its own
initialisation has run, one layer gathered at a time (see zinf/tiling.py).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zinf.config import ZeroConfig
from zinf.heap import trim_heap
from zinf.runtime.comm import Comm, compute_device, default_device
from zinf.runtime.context import RunContext
from zinf.offload.spill_store import SpillStore
from zinf.param.flat_group import FlatParamGroup, GroupState
from zinf.param.partition import agree_with_rank0, partition_module_params
from zinf.param.registry import group_of
from zinf import integrations, shutdown
from zinf.shutdown import phase

__all__ = ["Init"]

log = logging.getLogger(__name__)


# Tensor queries that read only metadata, which a released parameter's placeholder keeps (see [Note: releasing
# memory] in zinf/param/layout.py): code that counts or inspects parameters while the model is built (a loader checking
# shapes, ``sum(p.numel() ...)`` in ``configure_model``) gathers nothing.
_METADATA = frozenset({torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
                       torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.size,
                       torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
                       torch.Tensor.is_floating_point})


# In-place random fills. [Note: edits draw where plain PyTorch would] A parameter edited after its module was
# partitioned is gathered on the compute device and in the compute dtype, but without zinf it would still be on the
# device the model is built on (the CPU, unless a ``torch.device`` block says otherwise) and in the dtype it was built
# with: a fill there draws from that device's generator, at that width (torch's bf16 and fp32 fills need not
# draw the same numbers, nor consume the generator alike). So the fill (a Tensor method below, or any
# ``torch.nn.init`` function, which reaches this mode as itself with the tensor as ``tensor=``) runs on a copy on the
# construction device, in the parameter's built dtype, and is copied in. An edit such as GPT's
# ``apply(_init_weights)`` then gives the values of ``build().cuda()`` (rounded to bf16 under ``precision="bf16"``),
# as the module's own initialisation does.
_RANDOM_FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_,
                           torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
                           torch.Tensor.log_normal_, torch.Tensor.cauchy_})


class _EditMode(TorchFunctionMode):
    """Gathers partitioned parameters that construction code touches, and writes edits back. See module doc."""

    def __init__(self, ctx: RunContext, agree: Callable[[], bool]) -> None:
        super().__init__()
        self.ctx = ctx  # the Init's: edits gather through its process group and streams
        self.open: list[FlatParamGroup] = []
        self.agree = agree  # whether edits are made rank 0's before they are written back

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:  # a placeholder answers these as the full parameter would: nothing to gather
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        touched: list[FlatParamGroup] = []
        for t in tensors:
            g = group_of(t) if isinstance(t, nn.Parameter) else None
            if g is not None and g not in touched:
                touched.append(g)
        if self.open:
            ptrs = {t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0}
            for g in list(self.open):
                if g not in touched and g.full.untyped_storage().data_ptr() not in ptrs:
                    self.close(g)
        for g in touched:
            if g.state is not GroupState.GATHERED:
                g.acquire(self.ctx)
                self.open.append(g)
        if func in _RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            home = torch.get_default_device()
            group = (self._gathered_group(target, touched) if isinstance(target, torch.Tensor)
                     and home.type != "meta" and kwargs.get("generator") is None else None)
            slot = group.layout.slot_at(target.storage_offset() - group.full.storage_offset()) if group else None
            dtype = slot.dtype if slot is not None else target.dtype if group is not None else None
            if group is not None and (target.device != home or target.dtype != dtype):
                # [Note: edits draw where plain PyTorch would]
                local = target.detach().to(home, dtype)
                if args:
                    func(local, *args[1:], **kwargs)
                else:
                    func(**{**kwargs, "tensor": local})
                with torch.no_grad():
                    target.copy_(local)
                return target
        return func(*args, **kwargs)

    def _gathered_group(self, target: torch.Tensor, touched: list[FlatParamGroup]) -> FlatParamGroup | None:
        """The group whose gathered vector holds ``target``: a partitioned parameter, or a view of one
        (``weight.data``) gathered here; None for any other tensor."""
        if target.numel() == 0:
            return None
        ptr = target.untyped_storage().data_ptr()
        return next((g for g in (*touched, *self.open) if g.full.untyped_storage().data_ptr() == ptr), None)

    def close(self, group: FlatParamGroup) -> None:
        if group not in self.open:  # closed already by an operation that ran while closing another
            return
        self.open.remove(group)
        if self.agree():
            agree_with_rank0([group.full], self.ctx.comm, group.name)
        group.write_back()
        group.release()

    def close_all(self) -> None:
        while self.open:
            self.close(self.open[0])


_ACTIVE: list["Init"] = []  # the open Init blocks, innermost last


class Init:
    """Partition parameters while the model is built. Use ``with zinf.Init(config): model = Net()``."""

    @staticmethod
    def current() -> "Init | None":
        """The innermost open ``zinf.Init`` block, if any."""
        return _ACTIVE[-1] if _ACTIVE else None

    def __init__(self, config: ZeroConfig | Mapping[str, Any] | None = None, *, comm: Comm | None = None,
                 device: torch.device | str | None = None, enabled: bool = True) -> None:
        # a dict or an OmegaConf DictConfig, as zinf.initialize takes
        self.config = config if isinstance(config, ZeroConfig) else ZeroConfig.from_dict(config)
        self.enabled = enabled
        self.comm = comm
        self.device = compute_device(device) if device is not None else None
        self._handles: list[Any] = []
        self._pending: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._names: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self._parents: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # to find the roots for tiling
        self._agree = True
        self._spill: SpillStore | None = None  # [Note: construction spill]: shards built for NVMe go there
        self._phase = contextlib.ExitStack()  # the phase a fault line names while the block is open (zinf/shutdown.py)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        integrations.activate()  # a from_pretrained in this block builds the model partitioned (integrations/)
        self.comm = self.comm or Comm.current()
        self.device = self.device or default_device()
        self.ctx = RunContext.build(self.comm, self.device)  # what the edits' gathers move tensors with
        self._mode = _EditMode(self.ctx, agree=lambda: self._agree)
        shutdown.install(self.comm.rank, self.comm.world)  # see [Note: the fault line] in zinf/native/fault.py
        self._phase.enter_context(phase("building the model under zinf.Init"))
        self._handles = [
            nn.modules.module.register_module_module_registration_hook(self._on_child),
            nn.modules.module.register_module_parameter_registration_hook(self._on_param),
        ]
        self._mode.__enter__()
        _ACTIVE.append(self)
        return self

    @contextlib.contextmanager
    def placeholders(self) -> Iterator[None]:
        """Inside: the values being built are placeholders that a checkpoint's replace (a loader builds the model
        without initialising it), so the ranks' values are not compared (see [Note: initial values agree])."""
        before = self._agree
        self._agree = False
        try:
            yield
        finally:
            self._agree = before

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        try:
            self._mode.close_all()
            for module in list(self._pending):
                self._partition(module, self._names.get(module, ""))
        finally:
            self._mode.__exit__(None, None, None)
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._phase.__exit__(*exc)
            trim_heap()  # what the build freed since the last count's trim ([Note: heap growth] in zinf/heap.py)
        if self.config.tiling.enabled and not exc[0]:
            from zinf.tiling import tile_linears

            for root in [m for m in self._parents if m not in self._names]:  # built here, attached to nothing
                tile_linears(root, self.config.tiling, self.config.compute_dtype.itemsize, comm=self.comm)

    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and group_of(param) is None:
            self._pending.add(module)

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        self._parents.add(parent)
        for sub_name, sub in child.named_modules():
            self._names.setdefault(sub, f"{name}.{sub_name}" if sub_name else name)
            self._partition(sub, self._names[sub])

    def _partition(self, module: nn.Module, name: str) -> None:
        assert self.comm is not None and self.device is not None
        offload = self.config.offload
        to_nvme = offload.enabled and offload.params == "nvme"
        group = partition_module_params(module, name, self.comm, self.config.compute_dtype, self.device,
                                        storage_dtype=self.config.storage_dtype, agree=self._agree,
                                        placeholders=to_nvme and not self._agree)
        self._pending.discard(module)
        if group is None:
            return
        if to_nvme:
            if self._spill is None:
                self._spill = SpillStore(offload.nvme_paths[0], self.comm.rank, in_place=offload.frozen_in_place)
            group.spill_to(self._spill, placeholders=not self._agree)
        log.debug("zinf.Init partitioned %s: %d elements, %d per rank", group.name, group.numel, group.shard_numel)
