"""The client state in a checkpoint part: what a front end hands the engine to keep (Lightning's loops, callbacks and
LR schedulers, Fabric's extra state), stored as a torch file and read the way ``torch.load`` reads by default.

[Note: client state loading]
``zinf.client_state`` holds ``torch.save``'s bytes of the value. It is read with ``torch.load(weights_only=True)``:
tensors, containers and numbers come back, and a class or function named in the file is refused unless it is
torch's own, allowed by the user with ``torch.serialization.add_safe_globals``, or one of ``ALLOWED`` below: the
types the front ends store (each allowed only when the file names it, imported then). Anything else is an error
naming every such type and both ways to accept it; only ``checkpoint.allow_pickle=True`` (the user trusts the
file) reads it with ``weights_only=False``, which can run code.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from zinf.errors import CheckpointError

__all__ = ["ALLOWED", "dump_client_state", "load_client_state", "ALLOW_PICKLE_HINT"]

# qualified name -> who stores it
ALLOWED: dict[str, str] = {
    **{f"omegaconf.{name}": "Lightning's hyper-parameters given as an OmegaConf/Hydra config (and their type)"
       for name in ("dictconfig.DictConfig", "listconfig.ListConfig", "base.Metadata", "base.ContainerMetadata",
                    "nodes.AnyNode", "nodes.StringNode", "nodes.IntegerNode", "nodes.FloatNode", "nodes.BooleanNode",
                    "nodes.BytesNode", "nodes.PathNode")},
    "typing.Any": "an OmegaConf config's element type",
    "collections.defaultdict": "an OmegaConf config's flags",
    **{f"builtins.{name}": "an OmegaConf config's element types and defaultdict factories"
       for name in ("int", "float", "str", "bool", "bytes", "dict", "list", "tuple")},
    "argparse.Namespace": "hyper-parameters saved from argparse's result",
    "pathlib.PosixPath": "paths (a callback's directory)",
    "pathlib.WindowsPath": "paths (a callback's directory)",
    "pathlib.PurePosixPath": "paths",
    "pathlib.PureWindowsPath": "paths",
    "numpy.ndarray": "numpy arrays (metrics, random states)",
    "numpy.dtype": "numpy arrays and scalars",
    "numpy.core.multiarray._reconstruct": "numpy arrays (numpy 1)",
    "numpy._core.multiarray._reconstruct": "numpy arrays (numpy 2)",
    "numpy.core.multiarray.scalar": "numpy scalars (numpy 1)",
    "numpy._core.multiarray.scalar": "numpy scalars (numpy 2)",
}
_ALLOWED_PREFIXES = ("numpy.dtypes.",)  # numpy's dtype classes (Float64DType, ...)

ALLOW_PICKLE_HINT = ("set checkpoint.allow_pickle=True in the zinf config (ZeroConfig(checkpoint={'allow_pickle': "
                     "True}); the same key under a Lightning strategy's config, an Accelerator's zinf_config or the "
                     "zinf section of a zinf launch config), which reads it with weights_only=False")


def dump_client_state(value: Any) -> bytes:
    """``torch.save``'s bytes of ``value`` (tensors moved to the CPU by whoever reads them back)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _allowed(name: str) -> bool:
    return name in ALLOWED or name.startswith(_ALLOWED_PREFIXES)


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _with_dtype_classes(objects: list[Any]) -> list[Any]:
    """numpy arrays and scalars rebuild their dtype as an instance of its class (``Float64DType``), which the file
    does not name: allowed with ``numpy.dtype``."""
    numpy = importlib.import_module("numpy") if any(getattr(o, "__module__", "") == "numpy" and
                                                    getattr(o, "__name__", "") == "dtype" for o in objects) else None
    if numpy is None:
        return objects
    return [*objects, *sorted({type(numpy.dtype(t)) for t in set(numpy.sctypeDict.values())}, key=str)]


def _safe_globals(objects: list[Any]) -> contextlib.AbstractContextManager:
    """Allow ``objects`` for the loads inside the block (torch < 2.5 has no such block: allowed for good)."""
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        return scoped(objects)
    torch.serialization.add_safe_globals(objects)
    return contextlib.nullcontext()


def _unsafe_globals(data: bytes) -> list[str]:
    """The classes and functions the file names that torch's weights_only loader would refuse (``[]`` where this
    torch cannot list them: the load's own error names the first)."""
    lister = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)  # torch >= 2.5
    if lister is None:
        return []
    try:
        return list(lister(io.BytesIO(data)))
    except Exception:  # noqa: BLE001 - not a torch zip file: the load below names the problem
        return []


def _refused(file: Path, names: list[str], detail: str = "") -> CheckpointError:
    shown = ", ".join(names) if names else "an object torch's weights_only loader refuses"
    return CheckpointError(
        f"zinf checkpoint: {file}'s client state holds {shown}, which zinf does not load without being told the file "
        f"is trusted (unpickling it could run any code){f' ({detail})' if detail else ''}. Nothing was loaded. To "
        f"allow just these types: torch.serialization.add_safe_globals([...]) before loading; if you trust whoever "
        f"wrote this checkpoint: {ALLOW_PICKLE_HINT}.")


def load_client_state(data: bytes, file: Path, allow_pickle: bool) -> Any:
    """The value :func:`dump_client_state` wrote, loaded as [Note: client state loading] says."""
    if not data:
        return {}
    if allow_pickle:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    needed = _unsafe_globals(data)
    refused = [n for n in needed if not _allowed(n)]
    resolved = [_resolve(n) for n in needed if _allowed(n)]
    if refused or any(obj is None for obj in resolved):
        missing = [n for n in needed if _allowed(n) and _resolve(n) is None]
        raise _refused(file, refused + missing, "not importable here: " + ", ".join(missing) if missing else "")
    try:
        for _ in range(len(ALLOWED) + 2):  # torch < 2.5 cannot list the names first: each refusal names the next
            try:
                with _safe_globals(_with_dtype_classes(resolved)):
                    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                text = " ".join(str(exc).split())
                found = re.search(r"GLOBAL (\S+)|got <class '([^']+)'>", text)
                name = (found.group(1) or found.group(2)) if found else ""
                obj = _resolve(name) if name and _allowed(name) else None
                if obj is None or obj in resolved:
                    raise _refused(file, [name] if name else [], "" if name else text[:300]) from None
                resolved.append(obj)
        raise _refused(file, [], "more types than the allowed ones")
    except CheckpointError:
        raise
    except RuntimeError as exc:  # a CheckpointError is one too: passed on above
        raise CheckpointError(f"zinf checkpoint: {file}'s client state is not a torch file ({exc}). Nothing was "
                              "loaded; restore the file from a copy or load another checkpoint.") from None
