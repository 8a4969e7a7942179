"""The PyPI components of each Ascend target resolve together on aarch64 and x86_64, Python 3.12.

torch_npu pins one torch build per architecture: on aarch64 PyPI's `torch==2.10.0`, on x86_64
`torch==2.10.0+cpu`, which only the PyTorch CPU index serves (the manifest's `index_x86_64`, which
this machine cannot reach). So torch_npu's own requirements are checked against the resolution of
everything else, with the `+cpu` local build accepted only where the manifest names that index.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from verl_npu.stack import load_stack

SUPPORT = Path(__file__).resolve().parent / "support" / "cross_platform_pip.py"
REPORTS: dict[str, Path] = {}


def pypi_requirements(target: str) -> tuple[str, ...]:
    """Pinned packages of ``target`` from PyPI (own-index packages and torch_npu excluded)."""
    stack = load_stack()
    reqs = [p.requirement for p in stack.packages_for(target) if p.index is None and p.pairs_with is None]
    # On Ascend targets megatron-core comes from the Megatron-LM commit; the PyPI wheel of the same
    # version stands in for it so that its dependencies take part in the resolution.
    reqs.append(f"megatron-core=={stack.expected_versions(target)['megatron-core']}")
    return tuple(sorted(set(reqs)))


@functools.cache
def dry_run(arch: str, requirements: tuple[str, ...], no_deps: bool = False) -> list[dict]:
    report = Path(REPORTS["dir"]) / f"report-{arch}-{len(requirements)}-{abs(hash((requirements, no_deps)))}.json"
    extra = ["--no-deps"] if no_deps else []
    done = subprocess.run(
        [
            sys.executable, str(SUPPORT), arch,
            "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            "--disable-pip-version-check", *extra, *requirements,
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        errors = "\n".join(line for line in done.stderr.splitlines() if "Location" not in line)
        pytest.fail(f"pip could not resolve {' '.join(requirements)} for {arch}:\n{errors[-4000:]}")
    return json.loads(report.read_text())["install"]


@pytest.fixture(scope="module", autouse=True)
def report_dir(tmp_path_factory):
    REPORTS["dir"] = tmp_path_factory.mktemp("pip-reports")


@pytest.mark.network
@pytest.mark.parametrize("arch", ["aarch64", "x86_64"])
@pytest.mark.parametrize("target", ["a2", "a3"])
def test_pypi_components_resolve_together(target, arch):
    stack = load_stack()
    requirements = pypi_requirements(target)
    chosen = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in dry_run(arch, requirements)}
    for requirement in requirements:
        name, version = requirement.split("==")
        assert chosen.get(name) == version, f"{name}: resolver chose {chosen.get(name)}, pinned {version}"
    # verl composes its configs with Hydra 1.3; an ancient hydra-core means the resolver backtracked.
    assert chosen["hydra-core"].startswith("1.3"), chosen["hydra-core"]
    if arch == "aarch64":
        assert not any(name.startswith("nvidia-") for name in chosen), "x86_64-only CUDA wheels leaked into aarch64"

    torch_npu = stack.packages["torch-npu"]
    (item,) = dry_run(arch, (torch_npu.requirement,), no_deps=True)
    assert f"_{arch}.whl" in item["download_info"]["url"], item["download_info"]["url"]
    for text in item["metadata"].get("requires_dist") or []:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        have = chosen.get(name)
        assert have is not None, f"torch_npu needs {text}, which the resolution lacks"
        wanted = {Version(spec.version) for spec in req.specifier if spec.operator == "=="}
        if any(v.local for v in wanted):
            # A local build (torch 2.10.0+cpu): it must come from the manifest's per-arch index.
            assert arch == "x86_64" and stack.packages[name].index_x86_64, f"{text} needs an index the manifest lacks"
            assert {v.public for v in wanted} == {have}, f"torch_npu needs {text}, the pin is {have}"
        else:
            assert req.specifier.contains(have, prereleases=True), f"torch_npu needs {text}, resolution has {have}"
