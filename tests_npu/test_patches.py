"""Every file in patches/ is declared in the manifest, documented, and applies to its pinned source."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from verl_npu.stack import load_stack

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "patches").rglob("*.patch"))


def _owner(patch: Path):
    rel = str(patch.relative_to(REPO))
    owners = [pkg for pkg in load_stack().packages.values() if rel in pkg.patches]
    assert len(owners) == 1, f"{rel} must be listed under exactly one [packages.*] patches key"
    return owners[0]


def test_there_are_patches_and_each_is_declared_and_documented():
    assert PATCHES, "patches/ is empty"
    for patch in PATCHES:
        pkg = _owner(patch)
        header = patch.read_text().split("diff --git", 1)[0]
        for field in ("Target:", "Why:", "Remove when:"):
            assert field in header, f"{patch.name}: header lacks {field!r}"
        assert f"{pkg.name} {pkg.version}" in header, f"{patch.name}: header must name {pkg.name} {pkg.version}"


@pytest.mark.network
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: str(p.relative_to(REPO)))
def test_patch_applies_cleanly_to_the_pinned_sdist(patch, tmp_path):
    pkg = _owner(patch)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", "-d", str(tmp_path), pkg.requirement],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    archives = list(tmp_path.glob("*.tar.gz"))
    assert len(archives) == 1, archives
    tree = tmp_path / "src"
    with tarfile.open(archives[0]) as tar:
        tar.extractall(tree, filter="data")
    (root,) = tree.iterdir()
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree)}
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, env=env, capture_output=True, text=True)
    assert check.returncode == 0, f"{patch.name} does not apply to {pkg.requirement}: {check.stderr}"
    subprocess.run(["git", "apply", str(patch)], cwd=root, env=env, check=True)
    # Once applied, the reverse check succeeds: this is how install.sh and doctor detect it.
    reverse = subprocess.run(["git", "apply", "--reverse", "--check", str(patch)], cwd=root, env=env)
    assert reverse.returncode == 0
