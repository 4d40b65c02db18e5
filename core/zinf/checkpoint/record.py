"""The engine's record in a checkpoint part as data: JSON text, with the tensors it holds stored as tensors.

[Note: a record that is data]
A part's record (format, world, rank, commit, group layout, precision, optimizer hyper-parameters and
per-parameter scalars, loss scaler, step, tiling grids, buffer names) is the uint8 tensor ``zinf.meta`` holding
UTF-8 JSON, and every tensor inside it (a step count kept as a tensor, an ``lr`` tensor) is a tensor of the part
named ``zinf.meta.NNNNN``. Reading it is ``json.loads`` and tensor reads: no object is built from a name found in
the file, so opening a part runs no code whatever its bytes. JSON's own values stand for themselves; the rest are
one-key objects whose key starts with ``$``:

    {"$tuple": [...]}            a tuple (optimizer betas stay tuples)
    {"$tensor": "zinf.meta.N"}   a tensor of the part
    {"$float": "nan"}            a float JSON cannot spell: "nan", "inf", "-inf"
    {"$dict": [[key, value]]}    a dict whose keys are not all strings, or one with a key starting with "$"

Anything else (an object of a class) is refused when the part is written, naming where it is and its type.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import torch

from zinf.errors import CheckpointError

__all__ = ["RECORD", "TENSOR_PREFIX", "encode_record", "decode_record"]

RECORD = "zinf.meta"
TENSOR_PREFIX = "zinf.meta."
_TAGS = ("$tuple", "$tensor", "$float", "$dict")


def encode_record(value: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``value`` as JSON bytes, and the tensors it refers to by name (CPU, contiguous)."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, torch.Tensor):
            name = f"{TENSOR_PREFIX}{len(tensors):05d}"
            tensors[name] = v.detach().to("cpu").contiguous()
            return {"$tensor": name}
        if isinstance(v, tuple):
            return {"$tuple": [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, f"{where}.{k}") for k, x in v.items()}
            return {"$dict": [[enc(k, f"{where} key"), enc(x, f"{where}[{k!r}]")] for k, x in v.items()]}
        raise CheckpointError(
            f"zinf checkpoint: the engine's record holds a {type(v).__module__}.{type(v).__qualname__} at "
            f"{where.lstrip('.')}; a checkpoint stores there only None, bool, int, float, str, tensors, and lists, "
            "tuples and dicts of them (so that reading it runs no code). Keep such values in the optimizer's "
            "param_groups (e.g. a name as a str), or save the object in the client state.")

    text = json.dumps(enc(value, ""), separators=(",", ":"), allow_nan=False).encode()
    return text, tensors


def decode_record(text: bytes, read: Callable[[str], torch.Tensor]) -> Any:
    """The value :func:`encode_record` wrote; ``read(name)`` gives a tensor of the part. ValueError when ``text``
    is not such a record."""
    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1 and next(iter(v)) in _TAGS:
            tag, body = next(iter(v.items()))
            if tag == "$tuple":
                return tuple(dec(x) for x in body)
            if tag == "$tensor":
                if not isinstance(body, str) or not body.startswith(TENSOR_PREFIX):
                    raise ValueError(f"a tensor reference {body!r} outside {TENSOR_PREFIX}*")
                return read(body).clone()
            if tag == "$float":
                if body not in ("nan", "inf", "-inf"):
                    raise ValueError(f"a float {body!r}")
                return float(body)
            return {dec(k): dec(x) for k, x in body}
        if any(k.startswith("$") for k in v):
            raise ValueError(f"an unknown tag among {sorted(v)[:4]}")
        return {k: dec(x) for k, x in v.items()}

    try:
        return dec(json.loads(text.decode("utf-8")))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc})") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed ({exc})") from None
