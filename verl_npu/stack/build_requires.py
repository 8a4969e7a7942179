"""The build requirements of a source checkout, for install.sh's builds without build isolation.

An isolated build installs a component's ``[build-system] requires`` into a throwaway environment that
the stack's constraints do not reach: vLLM's names the torch its CUDA wheels are built with, so each image
build would download it just to read vLLM's metadata. Without isolation, install.sh installs those
requirements itself (under the constraints), except the ones the manifest says the stack provides.

Standard library only: install.sh runs it with the bare host Python.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.errors import UserError

MAX_PYPROJECT_BYTES = 4 * MIB
# PEP 508: a requirement starts with the distribution's name
_NAME_RE = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")


class BuildRequiresError(UserError):
    """A checkout's pyproject.toml cannot give its build requirements; the message names the file and why."""


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: ``Setuptools_SCM`` and ``setuptools-scm`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_requirements(pyproject: Path | str, skip: Iterable[str] = ()) -> list[str]:
    """``[build-system] requires`` of ``pyproject`` as written, without those naming a distribution in ``skip``.

    Every name in ``skip`` must be one of the requirements: a name the pinned source does not require
    means the manifest's list was written for another version of it.
    """
    path = Path(pyproject)
    try:
        raw = tomllib.loads(read_bytes(path, MAX_PYPROJECT_BYTES).decode("utf-8"))
    except NotReadable as exc:
        raise BuildRequiresError(
            f"{path}: cannot read it ({exc}); a build without isolation needs its [build-system]"
        ) from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise BuildRequiresError(f"{path}: not a valid TOML file ({exc})") from None
    system = raw.get("build-system")
    requires = system.get("requires") if isinstance(system, dict) else None
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise BuildRequiresError(f"{path}: [build-system] key 'requires' is missing or not a list of strings")

    wanted = {canonical_name(name) for name in skip}
    kept, seen = [], set()
    for requirement in requires:
        match = _NAME_RE.match(requirement)
        if match is None:
            raise BuildRequiresError(f"{path}: [build-system] requires entry {requirement!r} names no distribution")
        name = canonical_name(match.group(1))
        seen.add(name)
        if name not in wanted:
            kept.append(requirement.strip())
    stale = sorted(wanted - seen)
    if stale:
        raise BuildRequiresError(
            f"{path}: [build-system] requires does not list {', '.join(stale)}, which the manifest's "
            "build_requires_skip leaves out: update that key in verl_npu/stack/stack.toml for this source"
        )
    return kept
