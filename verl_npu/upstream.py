"""Pinned upstream sources that are not on PyPI, for running their real code off an Ascend node.

MindSpeed is published on gitcode only. The ``ascend_sim`` tests execute its Python at the commit the manifest pins
(verl_npu/stack/stack.toml); they find it through :data:`MINDSPEED_SOURCE_ENV` (a directory holding ``mindspeed/``,
or a ``.tar.gz`` of one), else beside the checkout in ``../shared/upstream/MindSpeed-<commit>.tar.gz`` (where CI
keeps it). ``verl-npu upstream fetch mindspeed`` makes that archive from the pinned commit where gitcode can be
reached. verl-npu never copies MindSpeed's code into its own tree.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path

from verl_npu import atomic, processes
from verl_npu.errors import UserError
from verl_npu.stack.manifest import REPO_ROOT, Stack, load_stack

MINDSPEED_SOURCE_ENV = "VERL_NPU_MINDSPEED_SRC"
# the file every MindSpeed source tree has (checked before anything imports it)
MINDSPEED_MARKER = Path("mindspeed") / "megatron_adaptor.py"
FETCH_TIMEOUT_S = 600


class UpstreamSourceError(UserError):
    """A source named by the user or the environment is missing, unreadable or not MindSpeed's."""


def archive_name(commit: str) -> str:
    return f"MindSpeed-{commit}.tar.gz"


def default_archive(stack: Stack | None = None, repo_root: Path = REPO_ROOT) -> Path:
    """Where CI keeps the pinned MindSpeed: ``<checkout>/../shared/upstream/MindSpeed-<commit>.tar.gz``."""
    commit = (stack or load_stack()).git["mindspeed"].commit
    return repo_root.parent / "shared" / "upstream" / archive_name(commit)


def locate_mindspeed(env: Mapping[str, str] | None = None, stack: Stack | None = None) -> Path | None:
    """The MindSpeed source to use (a directory or a tarball), or None when there is none.

    A path in :data:`MINDSPEED_SOURCE_ENV` must exist: naming a missing one is an error, never a silent skip.
    """
    env = os.environ if env is None else env
    named = env.get(MINDSPEED_SOURCE_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.exists():
            raise UpstreamSourceError(
                f"{MINDSPEED_SOURCE_ENV}={named}: no such file or directory; point it at a MindSpeed checkout or "
                "tarball at the pinned commit (verl-npu upstream fetch mindspeed makes one), or unset it"
            )
        return path
    path = default_archive(stack)
    return path if path.is_file() else None


def _tree_root(directory: Path, source: Path) -> Path:
    """``directory`` itself, or its one top-level folder, whichever holds ``mindspeed/``."""
    candidates = [directory, *(p for p in sorted(directory.iterdir()) if p.is_dir())]
    for candidate in candidates:
        if (candidate / MINDSPEED_MARKER).is_file():
            return candidate
    raise UpstreamSourceError(f"{source}: holds no {MINDSPEED_MARKER.as_posix()}; it is not a MindSpeed source tree")


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unpacked(source: Path, cache: Path) -> Path:
    """The directory holding ``mindspeed/`` for ``source``: the directory itself, or a tarball unpacked once into
    ``cache`` (keyed by its sha256; unpacked beside it and renamed, so concurrent users never see half a tree)."""
    source = Path(source)
    if source.is_dir():
        return _tree_root(source, source)
    if source.exists() and not stat.S_ISREG(source.stat().st_mode):  # is_tarfile would open a FIFO and block
        raise UpstreamSourceError(f"{source}: not a directory and not a regular file (a tar archive)")
    if not tarfile.is_tarfile(source):
        raise UpstreamSourceError(f"{source}: not a directory and not a tar archive")
    target = Path(cache) / f"{source.name.removesuffix('.tar.gz')}-{_sha256(source)[:16]}"
    if not target.is_dir():
        Path(cache).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}."))
        try:
            with tarfile.open(source) as tar:
                tar.extractall(staging, filter="data")
            try:
                staging.rename(target)
            except OSError:  # another process finished first: keep its tree
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _tree_root(target, source)


def as_installed(source: Path, cache: Path, stack: Stack | None = None) -> Path:
    """The directory holding ``mindspeed/`` as the images install it: ``source`` with the manifest's MindSpeed
    patches applied the way install.sh applies them (``git apply --check``, then ``git apply``), made once per
    source and patch set in ``cache``. A patch that does not apply is an error naming it."""
    stack = stack or load_stack()
    patches = [REPO_ROOT / patch for patch in stack.git["mindspeed"].patches]
    pristine = unpacked(source, cache)
    digest = hashlib.sha256(str(pristine).encode())
    for patch in patches:
        digest.update(patch.read_bytes())
    target = Path(cache) / f"{pristine.name}-installed-{digest.hexdigest()[:16]}"
    if target.is_dir():
        return target
    Path(cache).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{target.name}."))
    try:
        tree = staging / pristine.name
        shutil.copytree(pristine, tree, symlinks=True)
        for patch in patches:
            for args in (("apply", "--check", str(patch)), ("apply", str(patch))):
                done = _git(tree, *args, timeout=60)
                if not done.ok:
                    shown = patch.relative_to(REPO_ROOT) if patch.is_relative_to(REPO_ROOT) else patch
                    raise UpstreamSourceError(
                        f"{shown} does not apply to the MindSpeed source {source}: "
                        f"{done.describe()}; is it the pinned commit?"
                    )
        try:
            tree.rename(target)
        except OSError:  # another process finished first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _git(directory: Path, *args: str, timeout: float = FETCH_TIMEOUT_S) -> processes.Result:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(directory.parent), "GIT_TERMINAL_PROMPT": "0"}
    return processes.run(["git", "-C", str(directory), *args], timeout=timeout, env=env)


def fetch_mindspeed(dest: Path, stack: Stack | None = None) -> Path:
    """Fetch the manifest's MindSpeed commit from its URL and write ``dest/MindSpeed-<commit>.tar.gz``; returns it.

    The archive is written under a temporary name and renamed: an interrupted fetch leaves nothing under the name
    the tests look for. Raises :class:`UpstreamSourceError` naming the step that failed.
    """
    component = (stack or load_stack()).git["mindspeed"]
    dest = Path(dest)
    if not dest.is_dir():
        raise UpstreamSourceError(f"--dest {dest}: not a directory")
    archive = dest / archive_name(component.commit)
    why = atomic.output_problem(archive)  # before the fetch: a FIFO or device at the name is never replaced
    if why is not None:
        raise UpstreamSourceError(f"--dest {dest}: {archive.name}: {why}")
    with tempfile.TemporaryDirectory(prefix="verl-npu-mindspeed-") as scratch:
        work = Path(scratch) / "MindSpeed"
        work.mkdir()
        steps = (
            ("init", ("init", "-q")),
            ("fetch", ("fetch", "-q", "--depth", "1", component.url, component.commit)),
            ("checkout", ("-c", "advice.detachedHead=false", "checkout", "-q", "--detach", "FETCH_HEAD")),
        )
        for name, args in steps:
            done = _git(work, *args)
            if not done.ok:
                raise UpstreamSourceError(
                    f"git {name} of MindSpeed {component.commit} from {component.url} failed: {done.describe()}"
                )
        head = _git(work, "rev-parse", "HEAD").stdout.strip()
        if head != component.commit:
            raise UpstreamSourceError(f"{component.url} gave commit {head or '(none)'}, the pin is {component.commit}")

        def write_archive(temporary: Path) -> None:
            done = _git(work, "archive", "--format=tar.gz", f"--prefix=MindSpeed-{component.commit[:7]}/", "-o",
                        str(temporary), "HEAD")  # fmt: skip
            if not done.ok:
                raise UpstreamSourceError(f"git archive of MindSpeed {component.commit} failed: {done.describe()}")

        atomic.write_with(archive, write_archive)  # an interrupted fetch leaves nothing under the archive's name
    return archive
