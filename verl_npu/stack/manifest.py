"""Typed loader for the stack manifest ``verl_npu/stack/stack.toml``.

Standard library only: install.sh runs this package with the bare host Python before anything
is installed (``python3 -m verl_npu.stack plan --target a3``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.errors import UserError

MANIFEST_PATH = Path(__file__).with_name("stack.toml")
REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 4 * MIB
UNVERIFIED = "UNVERIFIED"
NPU_TARGETS = ("a2", "a3")
TARGETS = (*NPU_TARGETS, "dev")
GIT_INSTALL_KINDS = ("pip", "vllm-empty-device", "vllm-ascend")

# re.ASCII and \Z: pip, git and install.sh's plan lines read ASCII digits only (a version in Arabic-Indic digits is
# none to pip), and a value ends where its text does ('$' also matches before a final newline, which would split a
# plan line).
_SHA_RE = re.compile(r"^[0-9a-f]{40}\Z")
# PEP 440 public versions plus a local label; enough to reject typos such as "0.18,0".
_VERSION_RE = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9.]+)?\Z", re.ASCII)
_PYTHON_RE = re.compile(r"^3\.\d+\Z", re.ASCII)
_IMAGE_RE = re.compile(r"^[a-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)+:[A-Za-z0-9._-]+\Z", re.ASCII)
_SOC_RE = re.compile(r"^ascend[0-9a-z_]+\Z")
MAX_STRING = 1024  # no pin, URL, image or path comes near; a longer value is a mistake, not a pin
MAX_ENTRIES = 512  # packages, git components, targets or patches in one table or list
MAX_HBM_GIB = 1 << 16


class StackError(UserError):
    """The manifest is malformed. The message names the file, the table and the key."""


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    description: str
    cann_version: str
    base_image: str
    soc_version: str
    hbm_gib: int  # device memory of one NPU (what torch_npu sees as one device)


@dataclasses.dataclass(frozen=True)
class Package:
    name: str
    version: str
    targets: tuple[str, ...]
    index: str | None = None
    index_x86_64: str | None = None
    pairs_with: str | None = None
    patches: tuple[str, ...] = ()
    # Distributions that install the same import package as this one (upstream `triton` for
    # triton-ascend): the plan removes them after every other install and reinstalls this package.
    replaces: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclasses.dataclass(frozen=True)
class GitComponent:
    name: str
    url: str
    ref: str
    commit: str
    targets: tuple[str, ...]
    install: str
    version: str | None = None
    import_name: str | None = None
    patches: tuple[str, ...] = ()  # applied to the checkout (git apply --check first) before it is installed
    # False: install.sh installs the [build-system] requirements of the checkout's pyproject.toml, except
    # `build_requires_skip`, under the stack's constraints, then builds the component in this environment
    # (pip --no-build-isolation) instead of an isolated one that would fetch them (vLLM's pins another torch).
    build_isolation: bool = True
    build_requires_skip: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return self.commit != UNVERIFIED


@dataclasses.dataclass(frozen=True)
class Stack:
    path: Path
    schema: int
    python: str
    chips: Mapping[str, Chip]
    packages: Mapping[str, Package]
    git: Mapping[str, GitComponent]

    def packages_for(self, target: str) -> list[Package]:
        return [p for p in self.packages.values() if target in p.targets]

    def git_for(self, target: str) -> list[GitComponent]:
        return [g for g in self.git.values() if target in g.targets]

    def expected_versions(self, target: str) -> dict[str, str]:
        """Distribution name -> version that must be installed on ``target``."""
        versions = {p.name: p.version for p in self.packages_for(target)}
        for g in self.git_for(target):
            if g.version is not None:
                dist = "megatron-core" if g.name == "megatron-lm" else g.name
                versions[dist] = g.version
        return versions

    def constraints(self, target: str) -> list[str]:
        """pip constraints that keep every pinned distribution at its pin during any install."""
        return [f"{name}=={version}" for name, version in sorted(self.expected_versions(target).items())]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "python": self.python,
            "chips": {k: dataclasses.asdict(v) for k, v in self.chips.items()},
            "packages": {k: dataclasses.asdict(v) for k, v in self.packages.items()},
            "git": {k: dataclasses.asdict(v) for k, v in self.git.items()},
        }


# --- validation helpers ------------------------------------------------------------------------


class _Table:
    """One TOML table being validated; every error names the file, table and key."""

    def __init__(self, path: Path, where: str, data: Any):
        self.path, self.where = path, where
        if not isinstance(data, dict):
            self.fail(None, f"must be a table, found {type(data).__name__}")
        self.data: dict[str, Any] = data

    def fail(self, key: str | None, message: str) -> NoReturn:
        location = f"[{_name(self.where)}]" if key is None else f"[{_name(self.where)}] key '{_name(key)}'"
        raise StackError(f"{self.path}: {location} {message}")

    def check_keys(self, required: set[str], optional: set[str] = frozenset()) -> None:
        allowed = required | optional
        for key in self.data:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1) if len(key) <= 100 else []
                hint = f"; did you mean '{close[0]}'?" if close else ""
                self.fail(key, f"is not allowed here (allowed: {', '.join(sorted(allowed))}){hint}")
        for key in sorted(required):
            if key not in self.data:
                self.fail(key, "is missing")

    def string(self, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        value = self.data[key]
        if not isinstance(value, str) or not value:
            self.fail(key, f"must be a non-empty string, found {_show(value)}")
        if len(value) > MAX_STRING:
            self.fail(key, f"is {len(value)} characters long (at most {MAX_STRING}): {_show(value)}")
        if pattern is not None and not pattern.match(value):
            self.fail(key, f"is not {what}: {_show(value)}")
        return value

    def optional_string(self, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> str | None:
        return self.string(key, pattern, what) if key in self.data else None

    def targets(self, key: str = "targets") -> tuple[str, ...]:
        value = self.data[key]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            self.fail(key, f"must be a non-empty list of targets, found {_show(value)}")
        for target in value:
            if target not in TARGETS:
                self.fail(key, f"names unknown target {_show(target)} (valid: {', '.join(TARGETS)})")
        if len(set(value)) != len(value):
            self.fail(key, f"lists a target twice: {_show(value)}")
        return tuple(value)

    def url(self, key: str) -> str:
        value = self.string(key)
        if not _URL_RE.match(value):
            self.fail(key, f"must be an https:// URL, found {_show(value)}")
        return value


def _show(value: Any) -> str:
    """A value for a message: its repr, cut to 80 characters (a hostile manifest may hold a megabyte string)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _name(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


_URL_RE = re.compile(r"^https://\S+\Z")
_DIST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?\Z")


def _load_chip(path: Path, name: str, data: Any) -> Chip:
    t = _Table(path, f"chips.{name}", data)
    t.check_keys({"description", "cann_version", "base_image", "soc_version", "hbm_gib"})
    hbm = t.data["hbm_gib"]
    if not isinstance(hbm, int) or isinstance(hbm, bool) or hbm <= 0:
        t.fail("hbm_gib", f"must be a positive integer (GiB of device memory per NPU), found {_show(hbm)}")
    if hbm > MAX_HBM_GIB:
        t.fail("hbm_gib", f"is {_show(hbm)} GiB per NPU (at most {MAX_HBM_GIB})")
    return Chip(
        name=name,
        description=t.string("description"),
        cann_version=t.string("cann_version", _VERSION_RE, "a version"),
        base_image=t.string("base_image", _IMAGE_RE, "a fully tagged image reference (registry/name:tag)"),
        soc_version=t.string("soc_version", _SOC_RE, "an Ascend SOC_VERSION such as ascend910b1"),
        hbm_gib=hbm,
    )


def _patches(t: _Table) -> tuple[str, ...]:
    """The optional `patches` list: build-time source patches under patches/ (packages and git components)."""
    patches = t.data.get("patches", [])
    if not isinstance(patches, list) or not all(isinstance(p, str) for p in patches) or len(patches) > MAX_ENTRIES:
        t.fail("patches", f"must be a list of paths relative to the repository, found {_show(patches)}")
    for patch in patches:
        if len(patch) > MAX_STRING or not re.match(r"^patches/[A-Za-z0-9._/-]+\.patch\Z", patch) or ".." in patch:
            t.fail("patches", f"entry {_show(patch)} must be a path under patches/ ending in .patch")
    if len(set(patches)) != len(patches):
        t.fail("patches", f"lists a patch twice: {_show(patches)}")
    return tuple(patches)


def _load_package(path: Path, name: str, data: Any) -> Package:
    t = _Table(path, f"packages.{name}", data)
    t.check_keys({"version", "targets"}, {"index", "index_x86_64", "pairs_with", "patches", "replaces"})
    replaces = t.data.get("replaces", [])
    if (
        not isinstance(replaces, list)
        or len(replaces) > MAX_ENTRIES
        or not all(isinstance(r, str) and len(r) <= MAX_STRING and _DIST_RE.match(r) for r in replaces)
    ):
        t.fail("replaces", f"must be a list of distribution names, found {_show(replaces)}")
    if name in replaces:
        t.fail("replaces", f"names the package itself ({name!r})")
    return Package(
        name=name,
        version=t.string("version", _VERSION_RE, "a PEP 440 version"),
        targets=t.targets(),
        index=t.optional_string("index", _URL_RE, "an https:// URL"),
        index_x86_64=t.optional_string("index_x86_64", _URL_RE, "an https:// URL"),
        pairs_with=t.optional_string("pairs_with"),
        patches=_patches(t),
        replaces=tuple(replaces),
    )


def _build_fields(t: _Table) -> tuple[bool, tuple[str, ...]]:
    """The optional `build_isolation` (a boolean) and `build_requires_skip` (distribution names; without isolation)."""
    isolation = t.data.get("build_isolation", True)
    if not isinstance(isolation, bool):
        t.fail("build_isolation", f"must be true or false, found {_show(isolation)}")
    skip = t.data.get("build_requires_skip", [])
    if (
        not isinstance(skip, list)
        or len(skip) > MAX_ENTRIES
        or not all(isinstance(s, str) and len(s) <= MAX_STRING and _DIST_RE.match(s) for s in skip)
    ):
        t.fail("build_requires_skip", f"must be a list of distribution names, found {_show(skip)}")
    if len(set(skip)) != len(skip):
        t.fail("build_requires_skip", f"lists a distribution twice: {_show(skip)}")
    if skip and isolation:
        t.fail(
            "build_requires_skip",
            "applies only to a build without isolation: add `build_isolation = false` or remove the key",
        )
    return isolation, tuple(skip)


def _load_git(path: Path, name: str, data: Any) -> GitComponent:
    t = _Table(path, f"git.{name}", data)
    t.check_keys(
        {"url", "ref", "commit", "targets", "install"},
        {"version", "import_name", "patches", "build_isolation", "build_requires_skip"},
    )
    commit = t.string("commit")
    if commit != UNVERIFIED and not _SHA_RE.match(commit):
        t.fail(
            "commit",
            f"must be a full 40-character lowercase hex commit or {UNVERIFIED!r}, found {_show(commit)}",
        )
    install = t.string("install")
    if install not in GIT_INSTALL_KINDS:
        t.fail("install", f"must be one of {', '.join(GIT_INSTALL_KINDS)}, found {_show(install)}")
    build_isolation, build_requires_skip = _build_fields(t)
    return GitComponent(
        name=name,
        url=t.url("url"),
        ref=t.string("ref"),
        commit=commit,
        targets=t.targets(),
        install=install,
        version=t.optional_string("version", _VERSION_RE, "a PEP 440 version"),
        import_name=t.optional_string("import_name"),
        patches=_patches(t),
        build_isolation=build_isolation,
        build_requires_skip=build_requires_skip,
    )


def _components(path: Path, where: str, data: Any, load) -> dict:
    """The entries of [packages] or [git]: each name a distribution name, each table loaded by ``load``."""
    table = _Table(path, where, data)
    if len(table.data) > MAX_ENTRIES:
        table.fail(None, f"has {len(table.data)} entries (at most {MAX_ENTRIES})")
    for name in table.data:
        if len(name) > 100 or not _DIST_RE.match(name):
            table.fail(None, f"entry {_show(name)} is not a distribution name (letters, digits, '.', '_', '-')")
    return {n: load(path, n, d) for n, d in table.data.items()}


def load_stack(path: Path | str = MANIFEST_PATH) -> Stack:
    """Load and validate a manifest; raise :class:`StackError` naming the file and key (never another exception)."""
    path = Path(path)
    if not path.exists():
        raise StackError(f"{path}: manifest not found")
    try:
        raw = tomllib.loads(read_bytes(path, MAX_MANIFEST_BYTES).decode("utf-8"))
    except NotReadable as exc:
        raise StackError(f"{path}: cannot read the manifest ({exc})") from None
    except UnicodeDecodeError as exc:
        raise StackError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)  # tomllib quotes the offending key whole: keep its start and the position at its end
        text = text if len(text) <= 300 else text[:200] + " ... " + text[-90:]
        raise StackError(f"{path}: not valid TOML: {text}") from None
    except RecursionError:
        raise StackError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None

    top = _Table(path, "top level", raw)
    top.check_keys({"schema", "python", "chips", "packages", "git"})
    schema = raw["schema"]
    if not isinstance(schema, int) or isinstance(schema, bool) or schema != SCHEMA_VERSION:
        top.fail("schema", f"is {_show(schema)}; this verl-npu reads schema {SCHEMA_VERSION}")
    py = _Table(path, "python", raw["python"])
    py.check_keys({"version"})
    python = py.string("version", _PYTHON_RE, "a major.minor Python version")

    chips_table = _Table(path, "chips", raw["chips"])
    chips_table.check_keys(set(NPU_TARGETS))
    chips = {name: _load_chip(path, name, chips_table.data[name]) for name in NPU_TARGETS}
    packages = _components(path, "packages", raw["packages"], _load_package)
    git = _components(path, "git", raw["git"], _load_git)

    for pkg in packages.values():
        if pkg.pairs_with is not None and pkg.pairs_with not in packages:
            _Table(path, f"packages.{pkg.name}", {}).fail(
                "pairs_with", f"names {_show(pkg.pairs_with)}, which is not a [packages] entry"
            )
        for dist in pkg.replaces:
            if dist in packages:
                _Table(path, f"packages.{pkg.name}", {}).fail(
                    "replaces", f"names {dist!r}, which the manifest itself installs ([packages.{dist}])"
                )
    return Stack(path=path, schema=schema, python=python, chips=chips, packages=packages, git=git)
