"""Run a function right after a third-party module is first imported, so that zinf can wrap a library's classes
without importing the library itself (transformers' model code and its ``Trainer`` are wrapped this way)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any, Callable, Sequence

__all__ = ["when_imported", "wrap_once"]

_CALLBACKS: dict[str, list[Callable[[], object]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when a watched module is imported, lets the other finders find it and wraps its loader
    so that the module's callbacks run right after the module has executed."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in _CALLBACKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader

        class _Calling(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                for callback in _CALLBACKS.get(name, []):
                    callback()

        return importlib.util.spec_from_file_location(name, spec.origin, loader=_Calling())


def when_imported(name: str, callback: Callable[[], object]) -> None:
    """Call ``callback`` now if module ``name`` is imported already, else as soon as it is (once per registration;
    the callback itself must tolerate being called more than once)."""
    if name in sys.modules:
        callback()
        return
    _CALLBACKS.setdefault(name, []).append(callback)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def wrap_once(originals: dict[str, Any], name: str, wrap: Callable[[Any], bool]) -> bool:
    """Import module ``name`` and call ``wrap(module)``, unless ``originals`` (the wrapper's record of what it replaced)
    says that was done; False when the module cannot be imported. Importing it may itself run a ``when_imported``
    hook that wraps: then nothing is wrapped twice."""
    if originals:
        return True
    try:
        module = importlib.import_module(name)
    except ImportError:
        return False
    if originals:  # that import ran the hook, which wrapped already
        return True
    return wrap(module)
