"""verl_npu.upstream: where the pinned MindSpeed source is found, unpacked, patched as installed, and fetched."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu import upstream
from verl_npu.cli import main
from verl_npu.stack import load_stack


def _tree(root: Path, text: str = "VALUE = 1\n") -> Path:
    """A directory that looks like a MindSpeed checkout (its marker file and one module)."""
    (root / "mindspeed").mkdir(parents=True)
    (root / upstream.MINDSPEED_MARKER).write_text("def repatch(args):\n    return args\n")
    (root / "mindspeed" / "values.py").write_text(text)
    return root


def _tarball(tree: Path, target: Path, prefix: str) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        tar.add(tree, arcname=prefix)
    return target


def _git(directory: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(directory.parent), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


def _with_mindspeed(**changes):
    stack = load_stack()
    return dataclasses.replace(stack, git={**stack.git, "mindspeed": dataclasses.replace(stack.git["mindspeed"],
                                                                                          **changes)})  # fmt: skip


def test_a_source_named_in_the_environment_must_exist(tmp_path):
    with pytest.raises(upstream.UpstreamSourceError, match=f"{upstream.MINDSPEED_SOURCE_ENV}=.*no such file"):
        upstream.locate_mindspeed({upstream.MINDSPEED_SOURCE_ENV: str(tmp_path / "absent.tar.gz")})
    assert upstream.locate_mindspeed({upstream.MINDSPEED_SOURCE_ENV: str(tmp_path)}) == tmp_path


def test_the_default_is_the_pinned_archive_beside_the_checkout():
    commit = load_stack().git["mindspeed"].commit
    assert upstream.default_archive() == REPO.parent / "shared" / "upstream" / f"MindSpeed-{commit}.tar.gz"


def test_a_tarball_is_unpacked_once_and_its_tree_found_under_its_prefix(tmp_path):
    archive = _tarball(_tree(tmp_path / "src"), tmp_path / "ms.tar.gz", "MindSpeed-abc")
    first = upstream.unpacked(archive, tmp_path / "cache")
    assert first.name == "MindSpeed-abc" and (first / "mindspeed" / "values.py").read_text() == "VALUE = 1\n"
    (first / "mindspeed" / "values.py").write_text("VALUE = 2\n")  # a second call reuses the unpacked tree
    assert upstream.unpacked(archive, tmp_path / "cache") == first
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")], "a staging directory is left"


def test_what_is_not_a_mindspeed_source_is_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(upstream.UpstreamSourceError, match=re.escape("empty: holds no mindspeed/megatron_adaptor.py")):
        upstream.unpacked(tmp_path / "empty", tmp_path / "cache")
    text = tmp_path / "notes.tar.gz"
    text.write_text("not an archive")
    refused = re.escape("notes.tar.gz: not a directory and not a tar archive")
    with pytest.raises(upstream.UpstreamSourceError, match=refused):
        upstream.unpacked(text, tmp_path / "cache")


def test_as_installed_applies_the_manifests_patches_or_names_the_one_that_does_not_apply(tmp_path):
    source = _tree(tmp_path / "src")
    patch = tmp_path / "0001-value.patch"
    patch.write_text("--- a/mindspeed/values.py\n+++ b/mindspeed/values.py\n@@ -1 +1 @@\n-VALUE = 1\n+VALUE = 3\n")
    installed = upstream.as_installed(source, tmp_path / "cache", _with_mindspeed(patches=(str(patch),)))
    assert (installed / "mindspeed" / "values.py").read_text() == "VALUE = 3\n"
    assert (source / "mindspeed" / "values.py").read_text() == "VALUE = 1\n", "the source itself is never edited"

    drifted = _tree(tmp_path / "drifted", "VALUE = 7\n")
    with pytest.raises(upstream.UpstreamSourceError, match=re.escape("0001-value.patch does not apply")):
        upstream.as_installed(drifted, tmp_path / "cache2", _with_mindspeed(patches=(str(patch),)))


@pytest.fixture
def mirror(tmp_path) -> tuple[Path, str]:
    """A local git repository standing in for gitcode's MindSpeed, and its head commit."""
    repo = _tree(tmp_path / "mirror")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "pinned")
    _git(repo, "config", "uploadpack.allowReachableSHA1InWant", "true")  # as gitcode serves a fetch by commit
    return repo, _git(repo, "rev-parse", "HEAD")


def test_fetch_writes_the_pinned_commit_as_the_archive_the_tests_read(mirror, tmp_path):
    repo, commit = mirror
    dest = tmp_path / "dest"
    dest.mkdir()
    archive = upstream.fetch_mindspeed(dest, _with_mindspeed(url=repo.as_uri(), commit=commit))
    assert archive == dest / f"MindSpeed-{commit}.tar.gz"
    tree = upstream.unpacked(archive, tmp_path / "cache")
    assert tree.name == f"MindSpeed-{commit[:7]}" and (tree / "mindspeed" / "values.py").read_text() == "VALUE = 1\n"
    assert [p.name for p in dest.iterdir()] == [archive.name]


def test_fetch_of_a_commit_the_server_lacks_fails_naming_it_and_leaves_nothing(mirror, tmp_path):
    repo, _ = mirror
    dest = tmp_path / "dest"
    dest.mkdir()
    missing = "0" * 40
    with pytest.raises(upstream.UpstreamSourceError, match=f"git fetch of MindSpeed {missing} from {repo.as_uri()}"):
        upstream.fetch_mindspeed(dest, _with_mindspeed(url=repo.as_uri(), commit=missing))
    assert list(dest.iterdir()) == []


def test_the_fetch_command_names_a_destination_that_is_not_a_directory(tmp_path, capsys):
    assert main(["upstream", "fetch", "mindspeed", "--dest", str(tmp_path / "absent")]) == 2
    assert f"--dest {tmp_path / 'absent'}: not a directory" in capsys.readouterr().err


def test_fetch_never_replaces_what_is_not_a_regular_file_at_the_archives_name(mirror, tmp_path):
    repo, commit = mirror
    stack = _with_mindspeed(url=repo.as_uri(), commit=commit)
    dest = tmp_path / "dest"
    dest.mkdir()
    fifo = dest / f"MindSpeed-{commit}.tar.gz"
    os.mkfifo(fifo)
    with pytest.raises(upstream.UpstreamSourceError, match=f"{fifo.name}: it is a FIFO"):
        upstream.fetch_mindspeed(dest, stack)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(upstream.UpstreamSourceError, match="not a directory and not a regular file"):
        upstream.unpacked(fifo, tmp_path / "cache")  # tarfile.is_tarfile would block opening it
    fifo.unlink()
    kept = tmp_path / "archives" / "kept.tar.gz"  # a link into another directory is written through
    kept.parent.mkdir()
    kept.write_bytes(b"old")
    fifo.symlink_to(kept)
    upstream.fetch_mindspeed(dest, stack)
    assert fifo.is_symlink() and tarfile.is_tarfile(kept)
