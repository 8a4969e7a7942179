"""The build manifest: what install.sh actually installed, written once per image or venv.

install.sh's last step runs ``python -m verl_npu.stack.build_manifest write``; it checks every pinned
distribution against verl_npu/stack/stack.toml (a mismatch fails the build) and records the commits
that git components resolved to (the only record of MindSpeed's ref: its package metadata says
0.12.1 on every branch). ``verl-npu doctor`` compares the running environment with it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import MIB, NotReadable, read_text
from verl_npu.errors import UserError
from verl_npu.inputs import DuplicateKey, loads_json
from verl_npu.stack.manifest import MANIFEST_PATH, NPU_TARGETS, TARGETS, Stack, StackError, load_stack

FILENAME = "build-manifest.json"
ENV_VAR = "VERL_NPU_BUILD_MANIFEST"
DEFAULT_IMAGE_PREFIX = Path("/opt/verl-npu")


class BuildManifestError(RuntimeError):
    pass


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def same_version(installed: str | None, expected: str) -> bool:
    """Equal up to a local label (torch 2.10.0+cpu is torch 2.10.0)."""
    return installed is not None and installed.split("+", 1)[0] == expected.split("+", 1)[0]


def _read_resolved(path: Path | None) -> dict[str, str]:
    if path is None or not path.is_file():
        return {}
    resolved = {}
    for line in read_text(path, MIB).splitlines():
        if line.strip():
            name, commit = line.split()
            resolved[name] = commit
    return resolved


def installed_versions(stack: Stack, target: str) -> tuple[dict[str, dict[str, str | None]], list[str]]:
    """dist -> {expected, installed} for every pinned distribution of ``target``, and the mismatches
    as "dist: expected X, found Y" lines (empty when the environment is as pinned)."""
    versions = {}
    mismatches = []
    for dist, expected in sorted(stack.expected_versions(target).items()):
        found = installed_version(dist)
        versions[dist] = {"expected": expected, "installed": found}
        if not same_version(found, expected):
            mismatches.append(f"{dist}: expected {expected}, found {found or 'not installed'}")
    return versions, mismatches


def compose(stack: Stack, target: str, resolved: dict[str, str]) -> dict[str, Any]:
    """Everything but the date; raises when an installed version differs from the manifest."""
    if target not in TARGETS:
        raise BuildManifestError(f"unknown target {target!r}; valid: {', '.join(TARGETS)}")
    versions, mismatches = installed_versions(stack, target)
    if mismatches:
        raise BuildManifestError(
            "installed versions differ from verl_npu/stack/stack.toml:\n  " + "\n  ".join(mismatches)
        )
    git = {}
    for comp in stack.git_for(target):
        commit = resolved.get(comp.name)
        if commit is None:
            raise BuildManifestError(f"git component {comp.name} has no resolved commit (was it installed?)")
        if comp.verified and commit != comp.commit:
            raise BuildManifestError(f"{comp.name}: checked out {commit}, the manifest pins {comp.commit}")
        git[comp.name] = {
            "url": comp.url,
            "ref": comp.ref,
            "pinned_commit": comp.commit,
            "resolved_commit": commit,
            "verified": comp.verified,
        }
    doc: dict[str, Any] = {
        "schema": 1,
        "target": target,
        "stack_manifest_sha256": hashlib.sha256(stack.path.read_bytes()).hexdigest(),
        "python": platform.python_version(),
        "arch": platform.machine(),
        "versions": versions,
        "git": git,
    }
    if target in NPU_TARGETS:
        chip = stack.chips[target]
        doc["chip"] = {
            "soc_version": chip.soc_version,
            "cann_version": chip.cann_version,
            "base_image": chip.base_image,
        }
    return doc


def write(stack: Stack, target: str, prefix: Path, resolved: dict[str, str]) -> Path:
    """Write prefix/build-manifest.json whole or not at all (verl_npu.atomic: a directory, device or FIFO there is
    refused with OutputPathError, never replaced); leave it untouched when nothing changed."""
    from verl_npu import atomic

    doc = compose(stack, target, resolved)
    path = prefix / FILENAME
    if path.is_file():
        try:
            old = json.loads(read_text(path, MIB))
        except (OSError, ValueError):  # damaged or unreadable: it is rewritten
            old = None
        if isinstance(old, dict):
            old.pop("built_at", None)
        if old == doc:
            return path
    doc["built_at"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    atomic.write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def find() -> Path | None:
    """The build manifest of this environment: $VERL_NPU_BUILD_MANIFEST, the venv, then the image."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    for candidate in (Path(sys.prefix) / FILENAME, DEFAULT_IMAGE_PREFIX / FILENAME):
        if candidate.is_file():
            return candidate
    return None


def read(path: Path) -> dict[str, Any]:
    if not os.path.lexists(path):
        raise BuildManifestError(f"{path}: build manifest not found (set {ENV_VAR} or rerun install.sh)")
    try:
        doc = loads_json(read_text(path, MIB))  # a FIFO or /dev/zero named by the variable is refused, never read
    except NotReadable as exc:
        raise BuildManifestError(f"{path}: cannot read the build manifest: {exc}") from None
    except (json.JSONDecodeError, DuplicateKey) as exc:
        raise BuildManifestError(f"{path}: not valid JSON ({exc}); rerun install.sh to rewrite it") from None
    if not isinstance(doc, dict):
        raise BuildManifestError(f"{path}: expected a JSON object, found {type(doc).__name__}; rerun install.sh")
    for key in ("target", "versions", "git"):
        if key not in doc:
            raise BuildManifestError(f"{path}: key '{key}' is missing; rerun install.sh to rewrite it")
    return doc


def verify(stack: Stack, target: str, path: Path) -> list[str]:
    """Problems of an image's build manifest against ``stack`` (empty: the image is as pinned).

    Run inside a freshly built image (CI does, after each build): the target, the manifest the
    build read, every pinned version as installed now, and every git component's commit.
    """
    built = read(path)
    expected = compose(
        stack, target, {name: rec.get("resolved_commit", "") for name, rec in built.get("git", {}).items()}
    )
    problems = []
    if built.get("target") != target:
        problems.append(f"target: built for {built.get('target')!r}, expected {target!r}")
    if built.get("stack_manifest_sha256") != expected["stack_manifest_sha256"]:
        problems.append("stack_manifest_sha256: the image was built from a different stack.toml than it carries")
    for dist, record in expected["versions"].items():
        recorded = built.get("versions", {}).get(dist, {}).get("installed")
        if not same_version(recorded, record["expected"]):
            problems.append(f"{dist}: build manifest records {recorded}, the stack pins {record['expected']}")
    for name in expected["git"]:
        if name not in built.get("git", {}):
            problems.append(f"git component {name}: not recorded in the build manifest")
    return problems


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_npu.stack.build_manifest")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("--target", required=True)
    w.add_argument("--prefix", required=True, type=Path)
    w.add_argument("--resolved", type=Path)
    w.add_argument("--manifest", type=Path, default=MANIFEST_PATH)
    v = sub.add_parser("verify", help="check an image's build manifest against the stack it carries")
    v.add_argument("--target", required=True)
    v.add_argument("--path", type=Path, help="build-manifest.json (default: the one this environment uses)")
    v.add_argument("--manifest", type=Path, default=MANIFEST_PATH)
    args = parser.parse_args(argv)
    if args.command == "verify":
        path = args.path or find()
        try:
            if path is None:
                raise BuildManifestError(f"no build manifest found; set {ENV_VAR} or pass --path")
            problems = verify(load_stack(args.manifest), args.target, path)
        except (StackError, BuildManifestError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for problem in problems:
            print(f"build manifest {path}: {problem}", file=sys.stderr)
        if not problems:
            print(f"build manifest {path}: as pinned for target {args.target}")
        return 1 if problems else 0
    try:
        stack = load_stack(args.manifest)
        path = write(stack, args.target, args.prefix, _read_resolved(args.resolved))
    except (StackError, BuildManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (UserError, OSError) as exc:  # atomic.OutputPathError: --prefix names no place for the file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"build manifest: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
