"""verl-npu runtime layer, loaded in every process by ``import verl``.

Our images set ``VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor``; verl 0.9.1 imports the
module named there with a bare ``importlib.import_module`` during ``import verl``, so a failure
here stops the process loudly instead of training on the wrong stack.

Load sequence, once per process (``load()`` is idempotent and thread-safe):
  1. stack check: installed versions of every pinned distribution equal verl_npu/stack/stack.toml
     (``VERL_NPU_ALLOW_MISMATCH=1`` turns a mismatch into a loud warning);
  2. platform: ascend / cuda / cpu (``VERL_NPU_PLATFORM`` overrides); a torch_npu that cannot load
     is reported as a missing CANN environment;
  3. on Ascend only: import MegatronAdaptor (``megatron_adaptor``), TransformerEngineNPU
     (``transformer_engine``) and MindSpeed (``mindspeed.megatron_adaptor``), in that order, before
     ``megatron.core`` is first imported;
  4. schedule our runtime patches (verl_npu.runtime_patches): each applies when its target module is
     imported, so the layer adds almost nothing to ``import verl``;
  5. register the NPU Megatron engine (verl_npu.engine.verl_engine) with verl's EngineRegistry when
     ``verl.workers.engine`` is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

from verl_npu import platform as _platform
from verl_npu.errors import LoadOrderError, StackMismatchError, warn_loudly
from verl_npu.patching import ALLOW_MISMATCH_ENV, PENDING, PatchEngine, PatchRecord, hooks
from verl_npu.stack import build_manifest
from verl_npu.stack.manifest import TARGETS, load_stack

UPSTREAM_ADAPTORS = ("megatron_adaptor", "transformer_engine", "mindspeed.megatron_adaptor")


def _target() -> str:
    env = os.environ.get("VERL_NPU_TARGET")
    if env:
        if env not in TARGETS:
            raise StackMismatchError(f"VERL_NPU_TARGET={env!r} is not a target; valid: {', '.join(TARGETS)}")
        return env
    path = build_manifest.find()
    if path is not None and path.is_file():
        return build_manifest.read(path)["target"]
    return "dev"


def check_stack() -> list[str]:
    """Return the mismatches (empty when the stack is as pinned); raise unless allowed."""
    target = _target()
    _, mismatches = build_manifest.installed_versions(load_stack(), target)
    if not mismatches:
        return []
    message = (
        f"verl-npu: installed packages differ from the pinned stack (target {target}):\n  "
        + "\n  ".join(mismatches)
        + f"\nFix: bash install.sh --target {target} (run `verl-npu doctor` for details), "
        f"or set {ALLOW_MISMATCH_ENV}=1 to continue at your own risk."
    )
    if os.environ.get(ALLOW_MISMATCH_ENV) == "1":
        warn_loudly(message)
        return mismatches
    raise StackMismatchError(message)


def import_upstream_adaptors() -> list[str]:
    """Import the Ascend adaptation of Megatron in its required order; return what was imported."""
    if "megatron.core" in sys.modules:
        origin = getattr(sys.modules["megatron.core"], "__file__", "?")
        raise LoadOrderError(
            f"megatron.core was imported ({origin}) before verl_npu.megatron_adaptor. On Ascend, "
            f"{' -> '.join(UPSTREAM_ADAPTORS)} must patch Megatron before its first import. "
            "Import verl (with VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor) or "
            "verl_npu.megatron_adaptor before anything that imports megatron."
        )
    imported = []
    for name in UPSTREAM_ADAPTORS:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"verl-npu: cannot import {name} ({exc}); the Ascend images install it "
                "(bash install.sh --target a2|a3), check with `verl-npu doctor`"
            ) from exc
        imported.append(name)
    return imported


class Layer:
    """What ``load()`` did in this process."""

    def __init__(self, platform: str, mismatches: list[str], adaptors: list[str], engine: PatchEngine):
        self.platform = platform
        self.stack_mismatches = mismatches
        self.upstream_adaptors = adaptors
        self.engine = engine

    def records(self) -> list[PatchRecord]:
        return self.engine.records()

    def import_patch_targets(self) -> None:
        """Import every target module, so that each pending patch is applied (or fails) now."""
        from verl_npu import runtime_patches

        for patch in runtime_patches.ALL:
            record = self.engine.record(patch.id)
            if record is not None and record.status == PENDING:
                importlib.import_module(patch.module)

    def to_dict(self) -> dict:
        return {
            "platform": self.platform,
            "stack_mismatches": self.stack_mismatches,
            "upstream_adaptors": self.upstream_adaptors,
            "patches": [r.to_dict() for r in self.records()],
        }


def _register_engines(_module) -> None:
    importlib.import_module("verl_npu.engine.verl_engine")


_lock = threading.Lock()
LAYER: Layer | None = None


def load() -> Layer:
    global LAYER
    with _lock:
        if LAYER is not None:
            return LAYER
        from verl_npu import runtime_patches

        mismatches = check_stack()
        platform = _platform.detect()
        adaptors = import_upstream_adaptors() if platform == "ascend" else []
        engine = PatchEngine(platform)
        for patch in runtime_patches.ALL:
            engine.schedule(patch)
        # Our engines register with verl when verl's engine package is imported (not eagerly: it imports megatron).
        hooks.when_imported("verl.workers.engine", _register_engines)
        LAYER = Layer(platform, mismatches, adaptors, engine)
        return LAYER


load()
