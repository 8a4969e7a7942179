"""Every file in patches/ is declared in the manifest, documented, and applies to its pinned source."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu import upstream
from verl_npu.stack import load_stack

PATCHES = sorted((REPO / "patches").rglob("*.patch"))


def _owner(patch: Path):
    """The manifest table listing ``patch``: a [packages.*] (patched sdist) or a [git.*] (patched checkout)."""
    rel = str(patch.relative_to(REPO))
    stack = load_stack()
    owners = [
        *(p for p in stack.packages.values() if rel in p.patches),
        *(g for g in stack.git.values() if rel in g.patches),
    ]
    assert len(owners) == 1, f"{rel} must be listed under exactly one [packages.*] or [git.*] patches key"
    return owners[0]


def _target_label(owner) -> str:
    """What a patch header must name: the package and version, or the git component and ref."""
    return f"{owner.name} {owner.version}" if hasattr(owner, "requirement") else f"{owner.name} {owner.ref}"


def test_there_are_patches_and_each_is_declared_and_documented():
    assert PATCHES, "patches/ is empty"
    for patch in PATCHES:
        owner = _owner(patch)
        header = patch.read_text().split("diff --git", 1)[0]
        for field in ("Target:", "Why:", "Remove when:"):
            assert field in header, f"{patch.name}: header lacks {field!r}"
        assert _target_label(owner) in header, f"{patch.name}: header must name {_target_label(owner)}"
        if not hasattr(owner, "requirement"):
            assert owner.commit in header, f"{patch.name}: header must name the pinned commit {owner.commit}"


def _pinned_source(owner, tmp_path: Path) -> Path:
    """The pinned source tree a patch applies to: the package's sdist, the PyPI sdist of the git pin, or for
    MindSpeed (gitcode only) its pinned source where verl_npu/upstream.py finds it, copied."""
    from support.pypi import RELEASE_OF_COMMIT, sdist

    if owner.name == "mindspeed":
        source = upstream.locate_mindspeed()
        if source is None:
            pytest.skip(
                f"no MindSpeed source: not at {upstream.default_archive()} and ${upstream.MINDSPEED_SOURCE_ENV} "
                "is unset (a MindSpeed checkout or tarball at the pinned commit)"
            )
        root = tmp_path / "src"
        shutil.copytree(upstream.unpacked(source, tmp_path / "unpacked"), root, symlinks=True)
        return root
    if hasattr(owner, "requirement"):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", "-d", str(tmp_path / "dl"), owner.requirement],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        (archive,) = (tmp_path / "dl").glob("*.tar.gz")
    else:
        assert owner.commit in RELEASE_OF_COMMIT, f"{owner.name} {owner.commit}: no PyPI release recorded"
        archive = sdist(owner.name, RELEASE_OF_COMMIT[owner.commit])
    tree = tmp_path / "src"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    (root,) = tree.iterdir()
    return root


@pytest.mark.network
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: str(p.relative_to(REPO)))
def test_patch_applies_cleanly_to_the_pinned_sdist(patch, tmp_path):
    owner = _owner(patch)
    root = _pinned_source(owner, tmp_path)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, env=env, capture_output=True, text=True)
    assert check.returncode == 0, f"{patch.name} does not apply to {_target_label(owner)}: {check.stderr}"
    subprocess.run(["git", "apply", str(patch)], cwd=root, env=env, check=True)
    # Once applied, the reverse check succeeds: this is how install.sh and doctor detect it.
    reverse = subprocess.run(["git", "apply", "--reverse", "--check", str(patch)], cwd=root, env=env)
    assert reverse.returncode == 0
