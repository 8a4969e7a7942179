"""What a runtime patch declares. One `Patch` per target; the engine applies them."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

PLATFORMS = frozenset({"ascend", "cuda", "cpu"})
KINDS = ("replace", "wrap", "add")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class PatchSpecError(ValueError):
    """A patch declaration is malformed (a bug in verl_npu, caught by the tests)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One in-memory change to a third-party object.

    ``target`` is ``"package.module:Attribute.path"``. ``build`` receives the original object
    (``None`` for ``add``) and returns what replaces it. ``source_sha256`` fingerprints the
    original's source (for ``add``: the owner's source), so an upstream change forces a review.
    ``requires`` maps distribution names to PEP 440 specifiers. ``condition`` returns a reason to
    skip (``None`` to apply), for patches that only fill a gap (e.g. a missing CUDA extension).
    ``fingerprint_of`` names the code that reads the target when the target itself has no source
    (a module global such as ``None``).
    """

    id: str
    target: str
    kind: str
    platforms: frozenset[str]
    requires: Mapping[str, str]
    source_sha256: str
    reason: str
    upstream: str
    remove_when: str
    build: Callable[[Any], Any]
    condition: Callable[[], str | None] | None = None
    fingerprint_of: str | None = None  # attribute path in the target module whose source is hashed

    def __post_init__(self) -> None:
        if not _ID_RE.match(self.id):
            raise PatchSpecError(f"patch id {self.id!r} must be lowercase words joined by '-'")
        if not _TARGET_RE.match(self.target):
            raise PatchSpecError(f"patch {self.id}: target {self.target!r} must look like 'pkg.module:Attr.path'")
        if self.kind not in KINDS:
            raise PatchSpecError(f"patch {self.id}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.platforms or not set(self.platforms) <= PLATFORMS:
            raise PatchSpecError(
                f"patch {self.id}: platforms {sorted(self.platforms)} must be a subset of {sorted(PLATFORMS)}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", self.source_sha256):
            raise PatchSpecError(f"patch {self.id}: source_sha256 must be 64 hex characters")
        for text, what in ((self.reason, "reason"), (self.upstream, "upstream"), (self.remove_when, "remove_when")):
            if not text.strip():
                raise PatchSpecError(f"patch {self.id}: {what} must be stated")

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attribute_path(self) -> str:
        return self.target.split(":", 1)[1]


def source_fingerprint(obj: Any) -> str:
    """sha256 of an object's source, trailing whitespace ignored."""
    func = inspect.unwrap(obj) if callable(obj) else obj
    source = inspect.getsource(func)
    normalised = "\n".join(line.rstrip() for line in source.strip().splitlines())
    return hashlib.sha256(normalised.encode()).hexdigest()
