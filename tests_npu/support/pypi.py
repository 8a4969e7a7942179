"""Files from PyPI for the network-tier tests: downloaded once into a cache shared by every test (and by later
runs on the same machine), checked against PyPI's sha256 whenever they are used, not only when downloaded.

Uses PyPI's JSON simple API (PEP 691) directly: ``pip download`` of an sdist builds its metadata,
which for vllm-ascend needs torch and CANN.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from packaging.utils import canonicalize_name

PYPI = "https://pypi.org/simple"
# Where downloads are kept between tests and runs: $VERL_NPU_TEST_DOWNLOADS, else ~/.cache/verl-npu/test-downloads.
DOWNLOADS_ENV = "VERL_NPU_TEST_DOWNLOADS"


def cache_dir() -> Path:
    """The shared download cache of the network-tier tests."""
    env = os.environ.get(DOWNLOADS_ENV)
    return Path(env) if env else Path.home() / ".cache" / "verl-npu" / "test-downloads"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# The PyPI release whose sdist holds the source of a pinned git commit (checked where it matters: the
# vllm-ascend contracts are verified on that sdist). On a bump, record the new commit's release here.
RELEASE_OF_COMMIT = {"5cb98caaadeff42b5b62b996e34bb2aaa29d20fd": "0.23.0"}


def simple_files(project: str) -> list[dict]:
    """The files of a PyPI project (PEP 691 JSON simple API)."""
    request = urllib.request.Request(
        f"{PYPI}/{canonicalize_name(project)}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["files"]


def download(project: str, choose: Callable[[str], bool], cache: Path | None = None) -> Path:
    """The one file of ``project`` for which ``choose(filename)`` holds, in ``cache`` (default: the shared cache).

    A cached file whose sha256 is not PyPI's (truncated, edited) is downloaded again; a download is written to a
    temporary name and renamed, so a concurrent or interrupted run never leaves half a file under the real name.
    """
    files = [f for f in simple_files(project) if choose(f["filename"])]
    assert len(files) == 1, f"{project}: expected one matching file on PyPI, found {[f['filename'] for f in files]}"
    cache = cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    wanted = files[0]["hashes"]["sha256"]
    path = cache / files[0]["filename"]
    if path.is_file() and _sha256(path) == wanted:
        return path
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    with urllib.request.urlopen(files[0]["url"], timeout=600) as response, partial.open("wb") as out:
        while block := response.read(1 << 20):
            out.write(block)
    got = _sha256(partial)
    if got != wanted:
        partial.unlink()
        raise AssertionError(f"{path.name}: sha256 {got} differs from PyPI's {wanted}")
    partial.replace(path)
    return path


def sdist(project: str, version: str, cache: Path | None = None) -> Path:
    return download(project, lambda name: name == f"{project.replace('-', '_')}-{version}.tar.gz", cache)


def extract(archive: Path, inner: str, dest: Path) -> None:
    """Copy ``<top>/<inner>`` (a file, or every file of a directory) out of an sdist into ``dest``."""
    with tarfile.open(archive) as tar:
        members = [
            m for m in tar.getmembers() if m.isfile() and re.fullmatch(rf"[^/]+/{re.escape(inner)}(/.*)?", m.name)
        ]
        assert members, f"{archive.name} has no {inner}"
        for member in members:
            target = dest / member.name.split("/", 1)[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())


def contract_sources(contract_ids, make_root: Callable[[str], Path]) -> dict[str, Path]:
    """The files the given vLLM / vllm-ascend contracts read, extracted from the sdists the stack pins: component ->
    the root holding them (``make_root(component)`` makes it, e.g. pytest's ``tmp_path_factory.mktemp``)."""
    from verl_npu import contracts
    from verl_npu.stack import load_stack

    stack = load_stack()
    archives = {
        "vllm": sdist("vllm", stack.git["vllm"].version),
        "vllm-ascend": sdist("vllm-ascend", RELEASE_OF_COMMIT[stack.git["vllm-ascend"].commit]),
    }
    roots = {component: make_root(component) for component in archives}
    for contract in map(contracts.by_id, contract_ids):
        extract(archives[contract.component], contract.path, roots[contract.component])
    return roots
