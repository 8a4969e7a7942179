"""The Ascend images' Python environment, as far as it installs here: a virtual environment that sees exactly
the distributions the a2/a3 install plan puts in, taken from this (dev) environment, and nothing that only the
`dev` extra brings.

What the images' plan installs that also installs here (verl_npu/stack/plan.py):
- the pip steps the dev target shares with a2/a3: the dev target's plan is, by the manifest's `targets`, the part
  of the stack that installs off Ascend, at the same pins (megatron-core from PyPI there, from its Megatron-LM
  commit in the images: the same distribution and version);
- the `local` step: verl-npu with the extras the a2/a3 plan names, its requirements read from pyproject.toml
  (the file the image installs from), a self-reference such as `verl-npu[test]` followed.
Those requirements and their closure (each distribution's Requires-Dist, markers evaluated for this interpreter
and the extras asked of it) are the image's distributions here. Each one's files, as its RECORD lists them, are
linked from this environment's site-packages into a fresh venv made by `python -m venv --without-pip`; a top-level
name that an excluded distribution shares (a namespace package) is linked file by file. Python finds nothing
else: no ruff, check-jsonschema, kubernetes-validate, uv, nor pytest or hypothesis unless the plan asks for them.

Not here: the Ascend components (torch-npu, triton-ascend, torchaudio, vLLM, vllm-ascend, Megatron-LM's training
package, MindSpeed and the adaptors) and what only they require; `image_plan_gaps` names them.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from verl_npu.stack import load_stack
from verl_npu.stack.manifest import NPU_TARGETS, REPO_ROOT
from verl_npu.stack.plan import install_plan

PROJECT = "verl-npu"


@dataclasses.dataclass(frozen=True)
class ImageEnv:
    python: Path  # the venv's interpreter
    bin_dir: Path
    distributions: tuple[str, ...]  # canonical names, sorted
    extras: str  # the extras of the images' local step


def image_extras() -> str:
    """The extras the a2 and a3 plans install verl-npu with (one value: the images share one test run)."""
    stack = load_stack()
    found = {
        target: next(s.fields["extras"] for s in install_plan(stack, target) if s.kind == "local")
        for target in NPU_TARGETS
    }
    values = set(found.values())
    if len(values) != 1:
        raise AssertionError(f"the a2 and a3 plans install verl-npu with different extras: {found}")
    return values.pop()


def project_requirements(extras: str, pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[Requirement]:
    """verl-npu's requirements with ``extras`` (comma-separated), from pyproject.toml; self-references followed."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    found: list[Requirement] = [Requirement(text) for text in project["dependencies"]]
    pending, seen = [e for e in extras.split(",") if e], set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise AssertionError(f"{pyproject}: no [project.optional-dependencies] {extra}, which the plan installs")
        for text in optional[extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == PROJECT:
                pending.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def _installed(site: Path) -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=[str(site)]):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return found


def _closure(roots: list[Requirement], installed: dict[str, metadata.Distribution]) -> dict[str, set[str]]:
    """Canonical name -> extras asked of it, for every distribution ``roots`` need; a missing or mismatched one
    raises, naming it (this environment is then not the dev install the comparison assumes)."""
    wanted: dict[str, set[str]] = {}
    pending = list(roots)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        dist = installed.get(name)
        if dist is None:
            raise AssertionError(f"{requirement} is not installed in {sys.prefix}: rerun bash install.sh --dev")
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise AssertionError(f"{requirement} but {sys.prefix} has {dist.version}: rerun bash install.sh --dev")
        seen = wanted.get(name)
        if seen is not None and set(requirement.extras) <= seen:
            continue
        wanted[name] = (seen or set()) | set(requirement.extras)
        contexts = [{"extra": extra} for extra in ("", *sorted(wanted[name]))]
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate(env) for env in contexts):
                pending.append(sub)
    return wanted


def image_roots(extras: str) -> list[Requirement]:
    """What the images' plan asks for that installs here: the shared pip steps, and verl-npu with ``extras``."""
    stack = load_stack()
    roots = [Requirement(s.fields["requirement"]) for s in install_plan(stack, "dev") if s.kind == "pip"]
    return [*roots, Requirement(PROJECT), *project_requirements(extras)]


def image_plan_gaps() -> list[str]:
    """The a3 plan's installs that cannot be made here (Ascend only), by step name."""
    stack = load_stack()
    here = {s.name for s in install_plan(stack, "dev")}
    return [s.name for s in install_plan(stack, "a3") if s.kind in ("pip", "git") and s.name not in here]


def _top(path) -> str | None:
    parts = Path(path).parts
    return None if not parts or parts[0] == ".." else parts[0]


def _link_files(site: Path, target: Path, dist: metadata.Distribution, top: str) -> None:
    for path in dist.files or []:
        if _top(path) != top:
            continue
        source, link = site / path, target / path
        if source.is_file() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source)


def make_image_env(root: Path) -> ImageEnv:
    """A venv at ``root`` that sees the images' distributions (module docstring) from this environment."""
    site = Path(sysconfig.get_path("purelib"))
    installed = _installed(site)
    extras = image_extras()
    wanted = _closure(image_roots(extras), installed)

    owners: dict[str, set[str]] = {}
    for name, dist in installed.items():
        if not dist.files:
            if name in wanted:
                raise AssertionError(f"{name} {dist.version} has no RECORD: its files cannot be told apart")
            continue
        for path in dist.files:
            if (top := _top(path)) is not None:
                owners.setdefault(top, set()).add(name)

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    target = Path(
        subprocess.run(
            [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    for top, names in sorted(owners.items()):
        included = names & wanted.keys()
        if not included or not (site / top).exists():
            continue
        if included == names:
            (target / top).symlink_to(site / top)
        else:  # shared with a distribution the image does not have: only the included ones' files
            for name in sorted(included):
                _link_files(site, target, installed[name], top)
    return ImageEnv(root / "bin" / "python", root / "bin", tuple(sorted(wanted)), extras)
