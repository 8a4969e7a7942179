"""The image's whole pip plan resolves, for each Ascend target, on aarch64 and x86_64 (Python 3.12).

One resolution holds everything install.sh puts through pip's resolver on a2/a3, under the
manifest's constraints (install.sh passes them to every pip install):
- the manifest's PyPI pins of the target (torch, torchvision, torchaudio, transformers, mbridge, verl...);
- megatron-core: the PyPI wheel of the Megatron-LM pin's version stands in for the git install;
- vllm's install requirements with VLLM_TARGET_DEVICE=empty (its setup.py then reads
  requirements/common.txt), taken from the vllm sdist on PyPI;
- vllm's build requirements as install.sh installs them for its build without isolation (its
  pyproject's [build-system] requires less the manifest's build_requires_skip: no torch 2.11), taken
  from the same sdist: they land in the image's environment, beside everything else;
- vllm-ascend's requirements.txt at the pinned commit, taken from the PyPI sdist of that release (its
  sha256 must equal the one recorded below for the commit), with the manifest's patches applied the
  way install.sh applies them (`git apply --check`, then `git apply`);
- MindSpeed's requirements.txt (its setup.py's install requirements) at the pinned commit, with the
  manifest's patches applied. MindSpeed is on gitcode only: its source comes from $VERL_NPU_MINDSPEED_SRC
  or ../shared/upstream/ beside the checkout (verl_npu/upstream.py); where there is none, the MindSpeed
  part is skipped, naming both.

The resolver is uv (`uv pip compile --python-platform`, pinned in the dev extras): it evaluates markers
and wheel tags for the target architecture and trusts static sdist metadata instead of building it,
which pip cannot do for another architecture.

Not in the resolution, checked against it instead:
- torch_npu: its wheel pins one torch build per architecture, on x86_64 `torch==2.10.0+cpu`, which only
  the PyTorch CPU index serves (not reachable from every CI machine). A `+cpu` local build is accepted
  only where the manifest names that index (`index_x86_64`); in the resolution, PyPI's x86_64 builds of
  torch, torchvision and torchaudio (CUDA builds, same requirements) stand in for the CPU builds.
- triton-ascend: its cp312 wheels are only on the triton-ascend index; what vllm-ascend requires of it
  (and of torch_npu) must hold for the manifest's pin.
Not covered: MegatronAdaptor and TransformerEngineNPU (gitcode only, and no pinned source of them is
kept), and vllm-ascend's build requirements (install.sh builds it without isolation after installing
its requirements.txt, which lists them).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from support.pypi import PYPI, RELEASE_OF_COMMIT, cache_dir, download, extract, sdist

from verl_npu import contracts, upstream
from verl_npu.contracts.verify import verify
from verl_npu.stack import load_stack
from verl_npu.stack.build_requires import build_requirements
from verl_npu.stack.manifest import REPO_ROOT, Stack
from verl_npu.stack.plan import install_plan

# PyPI's x86_64 wheels of these are CUDA builds: an Ascend image must take them from the CPU index.
CPU_INDEX_BUILDS = ("torch", "torchvision", "torchaudio")
# Upstream distributions that install the import directory of a pinned Ascend package (both `triton/`).
SHARES_IMPORT_DIRECTORY_WITH = {"triton": "triton-ascend"}


def _apply_patches(tree: Path, patches: tuple[str, ...]) -> None:
    """As install.sh does: `git apply --check` first, then apply (never a fuzzy patch)."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    for patch in patches:
        for args in (["--check"], []):
            done = subprocess.run(
                ["git", "apply", *args, str(REPO_ROOT / patch)], cwd=tree, env=env, capture_output=True, text=True
            )
            assert done.returncode == 0, f"{patch} does not apply to the pinned source: {done.stderr}"


def _mindspeed_requirements(stack: Stack, root: Path) -> tuple[Path, Path] | str:
    """MindSpeed's requirements.txt at the pin, as pinned and as patched; or why there is no MindSpeed source."""
    source = upstream.locate_mindspeed(stack=stack)
    if source is None:
        return (
            f"no MindSpeed source: not at {upstream.default_archive(stack)} and ${upstream.MINDSPEED_SOURCE_ENV} "
            "is unset (a MindSpeed checkout or tarball at the pinned commit)"
        )
    # the whole tree as install.sh installs it: its patches applied (git apply --check, then apply), not only the
    # requirements.txt ones
    pinned = upstream.unpacked(source, root / "mindspeed-source")
    patched = upstream.as_installed(source, root / "mindspeed-source", stack)
    return pinned / "requirements.txt", patched / "requirements.txt"


@pytest.fixture(scope="session")
def plan_sources(tmp_path_factory) -> dict[str, Path | str]:
    """vllm's common and build requirements, and the requirements.txt of vllm-ascend and of MindSpeed, each as
    pinned and as patched (for MindSpeed: why it is missing, where its source is not here)."""
    stack = load_stack()
    root = tmp_path_factory.mktemp("image-pip-plan")
    cache = cache_dir()

    vllm = root / "vllm"
    vllm_sdist = sdist("vllm", stack.git["vllm"].version, cache)
    extract(vllm_sdist, "requirements", vllm)
    extract(vllm_sdist, "pyproject.toml", vllm)
    vllm_build = root / "vllm-build-requirements.txt"
    vllm_build.write_text(
        "\n".join(build_requirements(vllm / "pyproject.toml", stack.git["vllm"].build_requires_skip)) + "\n"
    )

    comp = stack.git["vllm-ascend"]
    assert comp.commit in RELEASE_OF_COMMIT, (
        f"no PyPI release recorded for vllm-ascend {comp.commit}: find the release whose sdist holds that commit, "
        "record it in tests_npu/support/pypi.py and the requirements.txt in contract vllm-ascend-requirements"
    )
    release = RELEASE_OF_COMMIT[comp.commit]
    archive = sdist("vllm-ascend", release, cache)
    pinned, patched = root / "vllm-ascend-pinned", root / "vllm-ascend-patched"
    for tree in (pinned, patched):
        extract(archive, "requirements.txt", tree)
    (result,) = verify([contracts.by_id("vllm-ascend-requirements")], {"vllm-ascend": pinned})
    assert result.ok, f"vllm_ascend-{release}.tar.gz's requirements.txt is not the pinned commit's: {result.detail}"
    _apply_patches(patched, comp.patches)
    sources = {
        "root": root,
        "cache": cache,
        "vllm": vllm / "requirements" / "common.txt",
        "vllm-build": vllm_build,
        "vllm-ascend": patched / "requirements.txt",
        "vllm-ascend-unpatched": pinned / "requirements.txt",
    }
    mindspeed = _mindspeed_requirements(stack, root)
    if isinstance(mindspeed, str):
        sources["mindspeed-missing"] = mindspeed
    else:
        sources["mindspeed-unpatched"], sources["mindspeed"] = mindspeed
    return sources


# --- the resolution -------------------------------------------------------------------------------


def _not_on_pypi(stack: Stack, target: str) -> set[str]:
    """Pinned packages that PyPI cannot serve for this target: own index, or paired per-arch builds."""
    return {p.name for p in stack.packages_for(target) if p.index is not None or p.pairs_with is not None}


def our_requirements(stack: Stack, target: str) -> list[str]:
    """The manifest's PyPI pins of ``target``, megatron-core's wheel standing in for the Megatron-LM pin."""
    reqs = [p.requirement for p in stack.packages_for(target) if p.name not in _not_on_pypi(stack, target)]
    reqs.append(f"megatron-core=={stack.expected_versions(target)['megatron-core']}")
    return sorted(set(reqs))


def _uv() -> str:
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(found).exists():
        pytest.fail("uv is not installed; run: bash install.sh --dev")
    return found


@functools.cache
def uv_compile(
    arch: str, workdir: Path, inputs: tuple[Path, ...], constraints: tuple[str, ...], excludes: tuple[str, ...]
):
    """`uv pip compile` for linux/ARCH, CPython 3.12 and PyPI only; returns the CompletedProcess."""
    tag = hashlib.sha256(repr((arch, inputs, constraints, excludes)).encode()).hexdigest()[:12]
    (workdir / f"constraints-{tag}.txt").write_text("\n".join(constraints) + "\n")
    (workdir / f"excludes-{tag}.txt").write_text("\n".join(excludes) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    return subprocess.run(
        [
            _uv(), "pip", "compile", "--quiet", "--no-config", "--no-header", "--no-annotate",
            "--python", sys.executable, "--python-version", load_stack().python,
            "--python-platform", f"{arch}-unknown-linux-gnu", "--index-url", PYPI,
            "--cache-dir", str(workdir / "uv-cache"),
            "--constraints", str(workdir / f"constraints-{tag}.txt"),
            "--excludes", str(workdir / f"excludes-{tag}.txt"),
            *map(str, inputs),
        ],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


def resolve_image_plan(sources: dict, target: str, arch: str, *, unpatched: str | None = None):
    """The image's pip plan (MindSpeed's part where its source is here); ``unpatched``: "vllm-ascend" or
    "mindspeed", whose requirements then go in as pinned, without our patches."""
    stack = load_stack()
    text = "\n".join(our_requirements(stack, target)) + "\n"
    ours = sources["root"] / f"ours-{hashlib.sha256(text.encode()).hexdigest()[:12]}.txt"  # a2 and a3 share one
    ours.write_text(text)
    inputs = [ours, sources["vllm"], sources["vllm-build"]]
    for name in ("vllm-ascend", "mindspeed"):
        if name in sources:
            inputs.append(sources[f"{name}-unpatched" if unpatched == name else name])
    return uv_compile(
        arch,
        sources["root"],
        tuple(inputs),
        tuple(stack.constraints(target)),
        tuple(sorted(_not_on_pypi(stack, target))),
    )


def _chosen(done: subprocess.CompletedProcess, what: str) -> dict[str, str]:
    if done.returncode != 0:
        pytest.fail(f"uv could not resolve {what}:\n{done.stderr[-4000:]}")
    chosen = {}
    for line in done.stdout.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            req = Requirement(line.split(" #")[0])
            (spec,) = req.specifier
            chosen[canonicalize_name(req.name)] = spec.version
    return chosen


def _requirements_file(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            assert not line.startswith("-"), f"{path.name}: option lines are not expected here: {line!r}"
            reqs.append(Requirement(line))
    return reqs


def _marker_environment(arch: str, python: str) -> dict[str, str]:
    return {
        "platform_machine": arch, "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
        "python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
        "platform_python_implementation": "CPython", "extra": "",
    }  # fmt: skip


def _wheel_requirements(wheel: Path, arch: str, python: str) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        metadata = HeaderParser().parse(io.TextIOWrapper(z.open(name), encoding="utf-8"))
    reqs = [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]
    env = _marker_environment(arch, python)
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


@pytest.mark.network
@pytest.mark.parametrize("arch", ["aarch64", "x86_64"])
@pytest.mark.parametrize("target", ["a2", "a3"])
def test_image_pip_plan_resolves(plan_sources, target, arch):
    stack = load_stack()
    chosen = _chosen(resolve_image_plan(plan_sources, target, arch), f"the {target} image's pip plan for {arch}")

    for requirement in our_requirements(stack, target):
        name, version = requirement.split("==")
        assert chosen.get(name) == version, f"{name}: resolver chose {chosen.get(name)}, pinned {version}"
    # verl composes its configs with Hydra 1.3; an ancient hydra-core means the resolver backtracked.
    assert chosen["hydra-core"].startswith("1.3"), chosen["hydra-core"]
    if arch == "aarch64":
        assert not any(name.startswith("nvidia-") for name in chosen), "x86_64-only CUDA wheels leaked into aarch64"

    steps = install_plan(stack, target)
    plan = [(step.kind, step.name) for step in steps]
    vllm_step = plan.index(("git", "vllm"))
    for name in CPU_INDEX_BUILDS:
        if name not in chosen:
            continue
        pkg = stack.packages.get(name)
        assert pkg is not None and pkg.index_x86_64 and target in pkg.targets, (
            f"{name} {chosen[name]} is in the image's pip plan but not pinned for {target} with index_x86_64: "
            "on x86_64 pip would install PyPI's CUDA build"
        )
        assert plan.index(("pip", name)) < vllm_step, f"{name} must be installed before vllm (from the CPU index)"

    # vLLM's build requirements resolve with the stack's torch: nothing asks for the torch 2.11 vLLM builds with.
    assert chosen["torch"] == stack.packages["torch"].version
    for req in _requirements_file(plan_sources["vllm-build"]):
        assert canonicalize_name(req.name) != "torch" and req.specifier.contains(chosen[canonicalize_name(req.name)])

    # What is not on PyPI (torch_npu, triton-ascend) must satisfy every requirement on it.
    not_on_pypi = _not_on_pypi(stack, target)
    inputs = ("vllm", "vllm-build", "vllm-ascend", "mindspeed")
    for path in (plan_sources[name] for name in inputs if name in plan_sources):
        for req in _requirements_file(path):
            name = canonicalize_name(req.name)
            if name in not_on_pypi:
                pin = stack.packages[name].version
                assert req.specifier.contains(pin, prereleases=True), (
                    f"{path.name} needs {req}, the manifest pins {pin}"
                )

    # torch_npu's own requirements, from its wheel for this architecture, hold in the resolution.
    torch_npu = stack.packages["torch-npu"]
    wheel = download(
        "torch-npu",
        lambda fn: fn.startswith(f"torch_npu-{torch_npu.version}-cp312-cp312-") and fn.endswith(f"_{arch}.whl"),
        plan_sources["cache"],
    )
    for req in _wheel_requirements(wheel, arch, stack.python):
        name = canonicalize_name(req.name)
        have = chosen.get(name)
        assert have is not None, f"torch_npu needs {req}, which the resolution lacks"
        wanted = {Version(spec.version) for spec in req.specifier if spec.operator == "=="}
        if any(v.local for v in wanted):
            # A local build (torch 2.10.0+cpu): it must come from the manifest's per-arch index.
            assert arch == "x86_64" and stack.packages[name].index_x86_64, f"{req} needs an index the manifest lacks"
            assert {v.public for v in wanted} == {have}, f"torch_npu needs {req}, the pin is {have}"
        else:
            assert req.specifier.contains(have, prereleases=True), f"torch_npu needs {req}, resolution has {have}"

    # A distribution that shares a pinned package's import directory (upstream triton, which vllm's
    # requirements bring on x86_64) is removed by the plan's replace step, after vllm and vllm-ascend.
    for dist, owner in SHARES_IMPORT_DIRECTORY_WITH.items():
        if dist not in chosen:
            continue
        replace = [i for i, s in enumerate(steps) if s.kind == "replace" and s.name == owner]
        assert replace, f"{dist} {chosen[dist]} arrives with the plan and shadows {owner}; no replace step removes it"
        assert dist in steps[replace[0]].fields["remove"].split(","), steps[replace[0]].line()
        assert replace[0] > plan.index(("git", "vllm-ascend")), "the replace step must follow vllm-ascend's install"

    if "mindspeed-missing" in plan_sources:
        pytest.skip(f"resolved without MindSpeed's requirements: {plan_sources['mindspeed-missing']}")


@pytest.mark.network
def test_pinned_vllm_ascend_requirements_conflict_with_the_stack_without_our_patch(plan_sources):
    """Why patches/vllm-ascend/ exists: unpatched, the pinned requirements.txt cannot resolve with the
    stack (it pins transformers==5.5.4; the stack pins 5.10.4, as verl 0.9.1 requires <5.11,>=5.5.3).
    When this starts to resolve, the transformers part of the patch is no longer needed."""
    done = resolve_image_plan(plan_sources, "a3", "aarch64", unpatched="vllm-ascend")
    assert done.returncode != 0, "the unpatched vllm-ascend requirements resolve: drop the transformers hunk"
    assert "transformers==5.5.4" in done.stderr and "transformers==5.10.4" in done.stderr, done.stderr[-3000:]


@pytest.mark.network
def test_pinned_mindspeed_requirements_conflict_with_the_stack_without_our_patch(plan_sources):
    """Why patches/mindspeed/ exists: MindSpeed's pinned requirements.txt caps numpy at 1.26.0 and verl 0.9.1
    requires numpy 2, so the image's pip plan has no resolution (installed step by step, numpy went down at
    the MindSpeed step and up past mistral-common's bound at verl's). When this resolves, drop the patch."""
    if "mindspeed-missing" in plan_sources:
        pytest.skip(plan_sources["mindspeed-missing"])
    done = resolve_image_plan(plan_sources, "a3", "aarch64", unpatched="mindspeed")
    assert done.returncode != 0, "the unpatched MindSpeed requirements resolve: drop its numpy patch"
    assert "numpy<=1.26.0" in done.stderr and "numpy>=2" in done.stderr, done.stderr[-3000:]
