"""Image tags derived from the stack manifest and the commit, never ``latest``.

``<registry>/verl-npu:<chip>-<manifest sha256, 12>-<git sha, 12>``: the manifest part changes with
any pin, the commit part with any code; a nightly job names the image built from its own commit.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from verl_npu.stack.manifest import MANIFEST_PATH, load_stack

DEFAULT_REGISTRY = "ghcr.io/verl-npu"
TAG = re.compile(r"^(?P<chip>[a-z0-9]+)-(?P<manifest>[0-9a-f]{12})-(?P<commit>[0-9a-f]{12})$")


def manifest_digest(manifest: str | Path = MANIFEST_PATH) -> str:
    return hashlib.sha256(Path(manifest).read_bytes()).hexdigest()[:12]


def image_tag(chip: str, commit: str, *, manifest: str | Path = MANIFEST_PATH, registry: str = DEFAULT_REGISTRY) -> str:
    stack = load_stack(manifest)
    if chip not in stack.chips:
        raise ValueError(f"chip {chip!r}: the manifest has {', '.join(sorted(stack.chips))}")
    if not re.fullmatch(r"[0-9a-f]{12,40}", commit):
        raise ValueError(f"commit {commit!r}: give a git sha (12 to 40 lowercase hex characters)")
    return f"{registry}/verl-npu:{chip}-{manifest_digest(manifest)}-{commit[:12]}"


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m verl_npu.ci.images", description=__doc__.split("\n")[0])
    parser.add_argument("--chip", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--registry", default=DEFAULT_REGISTRY)
    args = parser.parse_args(argv)
    try:
        print(image_tag(args.chip, args.commit, registry=args.registry))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
