"""Apply, record and revert runtime patches, in memory only.

Guarantees: applying a patch twice is applying it once; a second, different patch of the same
target is refused; every module-level alias of a replaced function or class is rebound (and
restored on revert); a drifted target (source fingerprint) or an unsupported dependency version
raises with expected vs found, unless VERL_NPU_ALLOW_MISMATCH=1 turns that into a loud warning.
Nothing is written to disk and nothing is shared between processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import os
import sys
import threading
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet

from verl_npu.errors import warn_loudly
from verl_npu.patching import hooks
from verl_npu.patching.spec import Patch, source_fingerprint

ALLOW_MISMATCH_ENV = "VERL_NPU_ALLOW_MISMATCH"
PATCH_MARK = "__verl_npu_patch__"
_MISSING = object()

APPLIED, APPLIED_WITH_WARNING, PENDING, SKIPPED = "applied", "applied-with-warning", "pending", "skipped"


class PatchError(RuntimeError):
    """Base class: a patch could not be applied as declared."""


class PatchDriftError(PatchError):
    """The target's source differs from the one the patch was written against."""


class PatchVersionError(PatchError):
    """An installed dependency version is outside the patch's declared range."""


class PatchConflictError(PatchError):
    """Another patch already replaced this target."""


class PatchMismatchWarning(RuntimeWarning):
    """A drift or version mismatch let through by VERL_NPU_ALLOW_MISMATCH=1."""


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    id: str
    target: str
    kind: str
    status: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Active:
    patch: Patch
    owner: Any
    attribute: str
    original: Any
    replacement: Any
    aliases: list[tuple[Any, str]]


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _resolve(module: ModuleType, attribute_path: str) -> Any:
    obj: Any = module
    for part in attribute_path.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_owner(module: ModuleType, attribute_path: str) -> tuple[Any, str]:
    parent, _, leaf = attribute_path.rpartition(".")
    return (_resolve(module, parent) if parent else module), leaf


def _raw_attribute(owner: Any, name: str) -> Any:
    """The attribute as stored (a class's own staticmethod, not the bound function)."""
    if isinstance(owner, type):
        return owner.__dict__.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


def _rebindable(obj: Any) -> bool:
    """Only functions and classes have aliases worth rebinding (never None or constants)."""
    return inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)


def _rebind_aliases(original: Any, replacement: Any, owner: Any) -> list[tuple[Any, str]]:
    """Every other module's name bound to ``original`` (``from x import f``) now names ``replacement``."""
    aliases: list[tuple[Any, str]] = []
    if not _rebindable(original):
        return aliases
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if not namespace or mod is owner:
            continue
        for alias, value in list(namespace.items()):
            if value is original:
                setattr(mod, alias, replacement)
                aliases.append((mod, alias))
    return aliases


class PatchEngine:
    """Per-process patch state. ``load()`` in verl_npu.megatron_adaptor owns the global one."""

    def __init__(self, platform: str, *, allow_mismatch: bool | None = None):
        self.platform = platform
        self.allow_mismatch = os.environ.get(ALLOW_MISMATCH_ENV) == "1" if allow_mismatch is None else allow_mismatch
        self._lock = threading.RLock()
        self._active: dict[str, _Active] = {}
        self._records: dict[str, PatchRecord] = {}
        self._hooks: dict[str, Any] = {}
        self._known: dict[str, Patch] = {}

    # --- records -----------------------------------------------------------------------------
    def records(self) -> list[PatchRecord]:
        with self._lock:
            return list(self._records.values())

    def record(self, patch_id: str) -> PatchRecord | None:
        return self._records.get(patch_id)

    def displaced(self) -> list[str]:
        """Applied patches whose target no longer holds our replacement: upstream code assigned over it since
        (MindSpeed's repatch assigns some DSA methods directly). Their records still say what was applied."""
        with self._lock:
            active = list(self._active.values())
        return [a.patch.id for a in active if _raw_attribute(a.owner, a.attribute) is not a.replacement]

    def _set(self, patch: Patch, status: str, detail: str) -> PatchRecord:
        record = PatchRecord(patch.id, patch.target, patch.kind, status, detail)
        self._records[patch.id] = record
        return record

    # --- checks ------------------------------------------------------------------------------
    def _mismatch(self, patch: Patch, error: type[PatchError], message: str) -> str:
        text = f"verl-npu patch {patch.id} ({patch.target}): {message}"
        if not self.allow_mismatch:
            raise error(f"{text}. Set {ALLOW_MISMATCH_ENV}=1 to apply it anyway (at your own risk).")
        warn_loudly(f"{text}; applied anyway because {ALLOW_MISMATCH_ENV}=1", PatchMismatchWarning)
        return message

    def _check_versions(self, patch: Patch) -> list[str]:
        problems = []
        for dist, spec in patch.requires.items():
            found = _installed(dist)
            if found is None or not SpecifierSet(spec).contains(found, prereleases=True):
                problems.append(
                    self._mismatch(patch, PatchVersionError, f"expects {dist}{spec}, found {found or 'not installed'}")
                )
        return problems

    # --- apply / revert ----------------------------------------------------------------------
    def _settled(self, patch: Patch) -> PatchRecord | None:
        """Remember the patch; return its record when it is already applied or not for this platform."""
        self._known[patch.id] = patch
        if patch.id in self._active:
            return self._records[patch.id]
        if self.platform not in patch.platforms:
            return self._set(patch, SKIPPED, f"platform {self.platform} not in {sorted(patch.platforms)}")
        return None

    def schedule(self, patch: Patch) -> PatchRecord:
        """Apply now if the target module is imported, else as soon as it is."""
        with self._lock:
            if (settled := self._settled(patch)) is not None:
                return settled
            if patch.id in self._hooks:
                return self._records[patch.id]

            def on_import(module: ModuleType, patch: Patch = patch) -> None:
                with self._lock:
                    self._hooks.pop(patch.id, None)
                self._apply_to(patch, module)

            self._hooks[patch.id] = on_import
            self._set(patch, PENDING, f"applies when {patch.module} is imported")
        hooks.when_imported(patch.module, on_import)
        return self._records[patch.id]

    def apply(self, patch: Patch) -> PatchRecord:
        """Import the target module and apply now."""
        with self._lock:
            if (settled := self._settled(patch)) is not None:
                return settled
        return self._apply_to(patch, importlib.import_module(patch.module))

    def _apply_to(self, patch: Patch, module: ModuleType) -> PatchRecord:
        with self._lock:
            if patch.id in self._active:  # apply twice == apply once
                return self._records[patch.id]
            self._refuse_second_patch_of_target(patch)
            warnings_seen = self._check_versions(patch)
            if patch.condition is not None:
                skip = patch.condition()
                if skip:
                    return self._set(patch, SKIPPED, skip)

            owner, name = _resolve_owner(module, patch.attribute_path)
            current = _raw_attribute(owner, name)
            warnings_seen += self._check_target(patch, module, owner, name, current)

            original = None if current is _MISSING else current
            replacement = patch.build(original)
            with contextlib.suppress(AttributeError, TypeError):
                setattr(replacement, PATCH_MARK, patch.id)
            setattr(owner, name, replacement)
            aliases = _rebind_aliases(original, replacement, owner) if patch.kind != "add" else []
            self._active[patch.id] = _Active(patch, owner, name, current, replacement, aliases)
            status = APPLIED_WITH_WARNING if warnings_seen else APPLIED
            detail = "; ".join(warnings_seen) if warnings_seen else f"{patch.kind} ({len(aliases)} aliases rebound)"
            return self._set(patch, status, detail)

    def _refuse_second_patch_of_target(self, patch: Patch) -> None:
        holder = next((a for a in self._active.values() if a.patch.target == patch.target), None)
        if holder is not None:
            raise PatchConflictError(
                f"verl-npu patch {patch.id}: target {patch.target} is already patched by {holder.patch.id}; "
                "two patches of one target are refused (merge them into one)"
            )

    def _check_target(self, patch: Patch, module: ModuleType, owner: Any, name: str, current: Any) -> list[str]:
        """The target is what the patch was written against: unpatched, present (absent for ``add``), same source.

        Returns the mismatches let through by the escape hatch; raises otherwise.
        """
        other = getattr(current, PATCH_MARK, None)
        if other is not None and other != patch.id:
            raise PatchConflictError(
                f"verl-npu patch {patch.id}: {patch.target} already carries patch {other} from elsewhere"
            )
        warnings_seen = []
        if patch.kind == "add":
            if current is not _MISSING:
                warnings_seen.append(
                    self._mismatch(
                        patch,
                        PatchDriftError,
                        f"expected {name!r} to be absent from {owner.__name__}, found it defined upstream",
                    )
                )
            fingerprint_of = owner
        else:
            if current is _MISSING:
                raise PatchDriftError(
                    f"verl-npu patch {patch.id}: expected {patch.target} to exist, found it missing "
                    "(upstream renamed or removed it; review the patch)"
                )
            fingerprint_of = current.__func__ if isinstance(current, staticmethod | classmethod) else current
        if patch.fingerprint_of is not None:
            fingerprint_of = _resolve(module, patch.fingerprint_of)
        found = source_fingerprint(fingerprint_of)
        if found != patch.source_sha256:
            warnings_seen.append(
                self._mismatch(
                    patch,
                    PatchDriftError,
                    f"source of {patch.target if patch.kind != 'add' else owner.__qualname__} changed: "
                    f"expected sha256 {patch.source_sha256[:16]}..., found {found[:16]}...",
                )
            )
        return warnings_seen

    def revert(self, patch: Patch) -> None:
        """Undo a patch (tests only): the target and every rebound alias get the original back."""
        with self._lock:
            callback = self._hooks.pop(patch.id, None)
            if callback is not None:
                hooks.cancel(patch.module, callback)
            active = self._active.pop(patch.id, None)
            self._records.pop(patch.id, None)
            self._known.pop(patch.id, None)
        if active is None:
            return
        if active.original is _MISSING:
            delattr(active.owner, active.attribute)
        else:
            setattr(active.owner, active.attribute, active.original)
        for mod, alias in active.aliases:
            if getattr(mod, alias, None) is active.replacement:
                setattr(mod, alias, active.original)

    def revert_all(self) -> None:
        with self._lock:
            patches = list(self._known.values())
        for patch in reversed(patches):
            self.revert(patch)
