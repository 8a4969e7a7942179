"""Declarative runtime patches: what a patch declares (spec), how it is applied (engine, hooks)."""

from verl_npu.patching.engine import (
    ALLOW_MISMATCH_ENV,
    APPLIED,
    APPLIED_WITH_WARNING,
    PENDING,
    SKIPPED,
    PatchConflictError,
    PatchDriftError,
    PatchEngine,
    PatchError,
    PatchMismatchWarning,
    PatchRecord,
    PatchVersionError,
)
from verl_npu.patching.spec import PLATFORMS, Patch, PatchSpecError, source_fingerprint

__all__ = [
    "ALLOW_MISMATCH_ENV",
    "APPLIED",
    "APPLIED_WITH_WARNING",
    "PENDING",
    "PLATFORMS",
    "SKIPPED",
    "Patch",
    "PatchConflictError",
    "PatchDriftError",
    "PatchEngine",
    "PatchError",
    "PatchMismatchWarning",
    "PatchRecord",
    "PatchSpecError",
    "PatchVersionError",
    "source_fingerprint",
]
