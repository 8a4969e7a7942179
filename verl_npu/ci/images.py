"""Image tags derived from the stack manifest and the commit, never ``latest``.

``<registry>/verl-npu:<chip>-<manifest sha256, 12>-<git sha, 12>``: the manifest part changes with
any pin, the commit part with any code; a nightly job names the image built from its own commit.
Each architecture is built on its own runner and pushed as ``<tag>-<arch>``; the merge step makes
``<tag>`` the multi-architecture image over those.

The registry comes from where the workflow runs (``ghcr.io/<repository owner>``, lowercased), so a fork
builds and pulls its own images; without one the tag is a local image name.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from verl_npu.stack.manifest import MANIFEST_PATH, load_stack

TAG = re.compile(
    r"^(?P<chip>[a-z0-9]+)-(?P<manifest>[0-9a-f]{12})-(?P<commit>[0-9a-f]{12})(?:-(?P<arch>amd64|arm64))?$"
)
ARCHES = ("amd64", "arm64")
# GitHub user and organisation names: alphanumerics and single inner hyphens, at most 39 characters.
_OWNER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}")
_REGISTRY = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")


def manifest_digest(manifest: str | Path = MANIFEST_PATH) -> str:
    from verl_npu.bounded_read import read_bytes
    from verl_npu.stack.manifest import MAX_MANIFEST_BYTES

    return hashlib.sha256(read_bytes(manifest, MAX_MANIFEST_BYTES)).hexdigest()[:12]


def ghcr_registry(owner: str) -> str:
    """``ghcr.io/<owner>`` for a GitHub repository owner; GHCR accepts lowercase names only."""
    if not _OWNER.fullmatch(owner):
        raise ValueError(
            f"owner {owner!r}: not a GitHub user or organisation name; pass the repository owner "
            "(${{ github.repository_owner }} in a workflow)"
        )
    return f"ghcr.io/{owner.lower()}"


def image_tag(
    chip: str,
    commit: str,
    *,
    manifest: str | Path = MANIFEST_PATH,
    registry: str | None = None,
    arch: str | None = None,
) -> str:
    stack = load_stack(manifest)
    if chip not in stack.chips:
        raise ValueError(f"chip {chip!r}: the manifest has {', '.join(sorted(stack.chips))}")
    if not re.fullmatch(r"[0-9a-f]{12,40}", commit):
        raise ValueError(f"commit {commit!r}: give a git sha (12 to 40 lowercase hex characters)")
    if arch is not None and arch not in ARCHES:
        raise ValueError(f"arch {arch!r}: images are built for {', '.join(ARCHES)}")
    if registry is not None and not _REGISTRY.fullmatch(registry):
        raise ValueError(
            f"registry {registry!r}: give a lowercase registry path such as ghcr.io/<owner> (or pass --owner)"
        )
    name = f"{registry}/verl-npu" if registry else "verl-npu"
    return f"{name}:{chip}-{manifest_digest(manifest)}-{commit[:12]}" + (f"-{arch}" if arch else "")


def add_arguments(parser) -> None:
    """The image-tag options, shared by ``python -m verl_npu.ci.images`` and ``verl-npu ci image-tag``."""
    parser.add_argument("--chip", required=True)
    parser.add_argument("--commit", required=True, help="git sha")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--registry", help="e.g. ghcr.io/<owner>; without it (and --owner) a local image name")
    where.add_argument("--owner", help="GitHub repository owner: the registry is ghcr.io/<owner, lowercased>")
    parser.add_argument("--arch", choices=ARCHES, help="the single-architecture tag one build job pushes")


def print_tag(args, prog: str) -> int:
    """Print the tag for parsed :func:`add_arguments` options; exit 2 with the reason on a bad value."""
    import sys

    try:
        registry = ghcr_registry(args.owner) if args.owner is not None else args.registry
        print(image_tag(args.chip, args.commit, registry=registry, arch=args.arch))
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_npu.ci.images", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return print_tag(parser.parse_args(argv), "python -m verl_npu.ci.images")


if __name__ == "__main__":
    raise SystemExit(_main())
