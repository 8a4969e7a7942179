"""verl 0.9.1's Megatron engine imported without verl's driver stack, for a machine that has not got it.

Packages reach the nvidia-h200 benchmark machine only as small wheels. verl's driver stack cannot come with them:
ray's wheel alone is 79 MB, and datasets (with pyarrow), pandas, wandb and tensorboard add as much. Yet the engine's
own path never calls any of them: build, forward, backward, optimizer step, offload, checkpoint and weight export.
verl imports them at module level for its trainer, its Ray workers and its datasets. So this loader does two things.

- It skips the package ``__init__`` files that import the driver stack wholesale: ``verl`` (DataProto, hence ray),
  ``verl.workers`` and ``verl.workers.engine`` (every engine: FSDP, hence datasets). Their modules load from the
  same installed files. ``verl.workers.engine`` gets the two names its submodules import from it: ``BaseEngine`` and
  ``EngineRegistry``, from ``verl.workers.engine.base``.
- Where a driver-stack package is absent, ``import`` of it gives a stand-in module. Every attribute of the stand-in
  is a placeholder class, so it works in an annotation, as a default or as a base class. Calling or instantiating
  one raises :class:`DriverStackUsed`, and every name touched is recorded (:func:`touched`). A benchmark states
  them, and it stops the moment its timed path uses one.

Everything that runs is verl's own code from its installed files. Nothing of verl is re-implemented.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

# the packages verl imports at module level on the engine's import path, none of which the engine's path calls
DRIVER_STACK = ("ray", "datasets", "pandas", "wandb", "tensorboard")
# verl's package __init__ files that import the driver stack wholesale (see the module docstring)
SKIPPED_INITS = ("verl", "verl.workers", "verl.workers.engine")
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"

_TOUCHED: dict[str, None] = {}  # ordered set of "module.attribute"


class DriverStackUsed(RuntimeError):
    """verl's engine path called into a package that is not on this machine (a stand-in)."""


class _PlaceholderMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise DriverStackUsed(f"{cls.__qualname__} was called: {cls.__qualname__.split('.')[0]} is not installed "
                              "here, and verl's engine path was expected never to use it")  # fmt: skip

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")


def _placeholder(qualname: str) -> type:
    _TOUCHED.setdefault(qualname, None)
    placeholder = _PlaceholderMeta(qualname.rpartition(".")[2], (), {})
    placeholder.__qualname__ = qualname
    return placeholder


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _placeholder(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name, f"stand-in for {spec.name} (verl_npu.testing.verl_without_driver)")
        module.__path__ = []  # a package: ``import ray.util.collective`` finds its submodules here too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.partition(".")[0] in self.names:
            return importlib.util.spec_from_loader(name, _StandInLoader(), is_package=True)
        return None


def _skip_init(name: str) -> None:
    """``name`` as a package whose ``__init__`` did not run: its submodules load from its folder."""
    parent, _, last = name.rpartition(".")
    where = importlib.util.find_spec("verl").submodule_search_locations[0] if not parent else None
    folder = where if where is not None else os.path.join(sys.modules[parent].__path__[0], last)
    package = types.ModuleType(name, f"{name} without its __init__ (verl_npu.testing.verl_without_driver)")
    package.__path__ = [folder]
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package.__spec__.submodule_search_locations = [folder]
    sys.modules[name] = package
    if parent:
        setattr(sys.modules[parent], last, package)


def import_engine(absent: tuple[str, ...] | None = None) -> types.ModuleType:
    """verl's ``verl.workers.engine.megatron.transformer_impl`` (MegatronEngine, MegatronEngineWithLMHead), with
    the driver-stack packages this machine lacks (``absent``: these, as a test has them) stood in for. Where verl
    was already imported whole (the machine has its driver stack), that module as it is."""
    unknown = [name for name in absent or () if name not in DRIVER_STACK]
    if unknown:
        raise ValueError(f"absent={unknown}: only the driver stack may be stood in for ({', '.join(DRIVER_STACK)})")
    if "verl" in sys.modules and getattr(sys.modules["verl"], "__file__", None):
        return importlib.import_module(ENGINE_MODULE)
    if absent is None:
        absent = tuple(name for name in DRIVER_STACK if importlib.util.find_spec(name) is None)
    if absent and not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder(absent))
    for name in SKIPPED_INITS:
        if name not in sys.modules:
            _skip_init(name)
    base = importlib.import_module("verl.workers.engine.base")
    engine_package = sys.modules["verl.workers.engine"]
    engine_package.BaseEngine, engine_package.EngineRegistry = base.BaseEngine, base.EngineRegistry
    return importlib.import_module(ENGINE_MODULE)


def stood_in() -> tuple[str, ...]:
    """The driver-stack packages this process imports as stand-ins."""
    finder = next((f for f in sys.meta_path if isinstance(f, _StandInFinder)), None)
    return finder.names if finder is not None else ()


def touched() -> list[str]:
    """Every stand-in attribute the imports touched (``ray.ObjectRef``: an annotation in verl.protocol)."""
    return list(_TOUCHED)
