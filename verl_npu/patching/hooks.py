"""Run callbacks right after a module is first imported (post-import hooks).

Patches wait for their target module instead of importing it: importing megatron.core eagerly
from the layer would add seconds to every `import verl` (see bench/import_time.py), and on Ascend
megatron must not be imported before MindSpeed's adaptor.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.RLock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def _is_ready(name: str) -> bool:
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _fire(module.__name__, module)

    def __getattr__(self, name):  # get_source, is_package, ... for tools that inspect loaders
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


_FINDER = _PostImportFinder()


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        callback(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> bool:
    """Call ``callback(module)`` once ``name`` is imported; now if it already is. True if now."""
    with _lock:
        if _is_ready(name):
            ready = True
        else:
            ready = False
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
    if ready:
        callback(sys.modules[name])
    return ready


def cancel(name: str, callback: Callable[[ModuleType], None]) -> None:
    with _lock:
        if callback in _pending.get(name, []):
            _pending[name].remove(callback)
            if not _pending[name]:
                del _pending[name]


def pending() -> dict[str, int]:
    with _lock:
        return {name: len(callbacks) for name, callbacks in _pending.items()}
