"""Drift lint: every version, tag, commit or image named outside the manifest must equal it.

Scans the files people copy pins from (docker/, install.sh, ci/, examples/, README.md and the docs/ pages that hold its
details, CONTRIBUTING.md, pyproject.toml) and reports each reference that disagrees with verl_npu/stack/stack.toml.

It also reads the messages of verl_npu's own Python (``MESSAGES``): the string literals, docstrings
included, of every module under verl_npu/. What counts there is a version stated in prose after the
name of a pinned component, "megatron-core 0.18", "torch_npu 2.10.0.post4", "vLLM 0.23.0", "CANN
9.1.0" (names as in the manifest, any case, ``-``/``_``/space alike), and a Megatron/MindSpeed
branch such as "core_r0.18.0". A stated version agrees when it is the pin or a prefix of it at a
component boundary ("megatron-core 0.18" and "Upstream: megatron-core 0.18.0 ..." agree with a
0.18.0 pin; an older minor release, or "0.1", does not). Not counted: comments (they may record how
an older CANN or Ray behaved), requirement specifiers such as ``NAME==X`` (in verl_npu's Python they
quote a third party's own requirements, which verl_npu/contracts checks against the source) and
components the manifest does not pin. A message that must name another release of a pinned
component names it without the component's name in front (e.g. "the release before").
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from verl_npu.stack.manifest import Stack

# README.md's details live in docs/ pages it links; those pages state versions as README did. (The other docs/ pages
# quote upstream's own pins and older releases on purpose: docs/ascend_contracts.md, docs/upstream_facts.md.)
README_PAGES = tuple(
    f"docs/{page}.md"
    for page in ("stack", "ascend_path", "runtime_layer", "engine", "kernels", "preflight", "glm5_2", "clusters",
                 "layout", "rl_step", "parity")
)  # fmt: skip
SCANNED = ("docker", "install.sh", "ci", "examples", "README.md", "CONTRIBUTING.md", *README_PAGES, "pyproject.toml",
           ".ci")  # fmt: skip
MESSAGES = "verl_npu"  # Python under it: its string literals are read for stated versions
_TEXT_SUFFIXES = {"", ".sh", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".py", ".cfg", ".a2", ".a3"}
_SHA_RE = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{40}(?![0-9a-fA-F])")
_IMAGE_RE = re.compile(r"[a-z0-9.-]+\.[a-z]{2,}(?::\d+)?/[a-z0-9._/-]*cann:[A-Za-z0-9._-]+")
_FROM_RE = re.compile(r"^\s*FROM\s+(\S+)", re.M)
_SOC_RE = re.compile(r"SOC_VERSION[=: \"']+(ascend[0-9a-z_]+)")
_MEGATRON_REF_RE = re.compile(r"\bcore_[rv]\d+\.\d+\.\d+\b")
_PY_RE = re.compile(r"(?:\bpython|\bpy|Python )(3\.\d+)\b")
_CANN_RE = re.compile(r"(?i)\bcann[-: ]?(?:version[= ]+)?v?(\d+\.\d+\.\d+[A-Za-z0-9.]*)")
_TARGET_RE = re.compile(r"install\.sh\b[^\n]*--target[= ](a2|a3|dev)\b")
_RELEASE_REF_RE = re.compile(r"^v?(\d+(?:\.\d+)+)$")  # a git ref that names a release: v0.23.0


@dataclasses.dataclass(frozen=True)
class Drift:
    path: str
    line: int
    found: str
    expected: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: found {self.found}, manifest says {self.expected}"


def scanned_files(root: Path) -> list[Path]:
    files = []
    for entry in SCANNED:
        path = root / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
    return files


def message_files(root: Path) -> list[Path]:
    """verl_npu's Python modules, whose messages are read for stated versions."""
    return sorted(p for p in (root / MESSAGES).rglob("*.py") if p.is_file())


def _loose_name(name: str) -> str:
    # torch-npu == torch_npu (== "torch npu" in prose)
    return re.escape(name).replace(r"\-", "[-_ ]")


def _package_pattern(name: str) -> re.Pattern[str]:
    # a pin is NAME==X, NAME===X or NAME~=X (also inside quotes).
    return re.compile(rf"(?<![\w.-]){_loose_name(name)}\s*(===|==|~=)\s*v?([0-9][0-9A-Za-z.+]*)", re.I)


def _prose_pattern(name: str) -> re.Pattern[str]:
    # "megatron-core 0.18", "torch_npu 2.10.0.post4", "vLLM v0.23.0"; not "vllm-ascend 0.23" for vllm
    return re.compile(rf"(?<![\w.-]){_loose_name(name)} +v?(\d+\.\d+(?:\.\d+)*(?:\.?post\d+)?)(?![\w-])", re.I)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@dataclasses.dataclass(frozen=True)
class _Pins:
    """What the manifest pins, in the forms the checks look them up by."""

    python: str
    versions: dict[str, str]  # distribution -> version, every target
    commits: dict[str, str]  # verified commit -> component
    refs: frozenset[str]
    images: dict[str, str]
    socs: dict[str, str]
    canns: frozenset[str]
    patterns: dict[str, re.Pattern[str]]  # distribution -> its requirement-specifier pattern
    prose: dict[str, tuple[re.Pattern[str], frozenset[str]]]  # name -> (its prose pattern, pinned versions)

    @classmethod
    def of(cls, stack: Stack) -> _Pins:
        versions = dict(stack.expected_versions("dev"))
        for target in ("a2", "a3"):
            versions.update(stack.expected_versions(target))
        stated = {name: {version} for name, version in versions.items()}
        for g in stack.git.values():
            release = g.version or (m.group(1) if (m := _RELEASE_REF_RE.match(g.ref)) else None)
            if release is not None:
                stated.setdefault(g.name, set()).add(release)
        stated["cann"] = {c.cann_version for c in stack.chips.values()}
        return cls(
            python=stack.python,
            versions=versions,
            commits={g.commit: g.name for g in stack.git.values() if g.verified},
            refs=frozenset(g.ref for g in stack.git.values()),
            images={c.base_image: c.name for c in stack.chips.values()},
            socs={c.soc_version: c.name for c in stack.chips.values()},
            canns=frozenset(c.cann_version for c in stack.chips.values()),
            patterns={name: _package_pattern(name) for name in versions},
            prose={name: (_prose_pattern(name), frozenset(v)) for name, v in stated.items()},
        )


# A check yields (position in the text, what was found, what the manifest expects) per disagreement.
_Finding = tuple[int, str, str]
_Check = Callable[[_Pins, str], Iterator[_Finding]]


def _package_pins(pins: _Pins, text: str) -> Iterator[_Finding]:
    for name, pattern in pins.patterns.items():
        for m in pattern.finditer(text):
            if m.group(2).split("+")[0] != pins.versions[name]:
                yield m.start(), m.group(0), f"{name}=={pins.versions[name]}"


def _commits(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _SHA_RE.finditer(text):
        if m.group(0) not in pins.commits:
            yield (
                m.start(),
                f"commit {m.group(0)}",
                f"one of the pinned commits ({', '.join(sorted(pins.commits.values()))})",
            )


def _images(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _IMAGE_RE.finditer(text):
        if m.group(0) not in pins.images:
            yield m.start(), f"image {m.group(0)}", " or ".join(sorted(pins.images))


def _socs(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _SOC_RE.finditer(text):
        if m.group(1) not in pins.socs:
            yield m.start(), f"SOC_VERSION {m.group(1)}", " or ".join(sorted(pins.socs))


def _megatron_refs(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _MEGATRON_REF_RE.finditer(text):
        if m.group(0) not in pins.refs:
            yield (
                m.start(),
                f"ref {m.group(0)}",
                f"one of {', '.join(sorted(r for r in pins.refs if r.startswith('core_')))}",
            )


def _pythons(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _PY_RE.finditer(text):
        if m.group(1) != pins.python:
            yield m.start(), m.group(0), f"Python {pins.python}"


def _canns(pins: _Pins, text: str) -> Iterator[_Finding]:
    for m in _CANN_RE.finditer(text):
        if m.group(1) not in pins.canns:
            yield m.start(), m.group(0), f"CANN {' or '.join(sorted(pins.canns))}"


def _requires_python(pins: _Pins, text: str) -> Iterator[_Finding]:
    if "requires-python" in text:
        m = re.search(r'requires-python\s*=\s*"([^"]+)"', text)
        if m and f">={pins.python}" not in m.group(1):
            yield m.start(), m.group(0), f"requires-python starting at >={pins.python}"


def _agrees(stated: str, pinned: str) -> bool:
    """The stated version is the pin or names it at a coarser level: 0.18 and 0.18.0 for 0.18.0."""
    return pinned == stated or pinned.startswith(stated + ".") or pinned.startswith(stated + "post")


def _stated_versions(pins: _Pins, text: str) -> Iterator[_Finding]:
    for name, (pattern, pinned) in pins.prose.items():
        for m in pattern.finditer(text):
            if not any(_agrees(m.group(1), version) for version in pinned):
                yield m.start(), m.group(0), f"{name} {' or '.join(sorted(pinned))}"


_TEXT_CHECKS: tuple[_Check, ...] = (
    _package_pins, _commits, _images, _socs, _megatron_refs, _pythons, _canns, _requires_python,
)  # fmt: skip
_MESSAGE_CHECKS: tuple[_Check, ...] = (_stated_versions, _megatron_refs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _text_drift(pins: _Pins, rel: str, text: str) -> list[Drift]:
    return [
        Drift(rel, _line_of(text, pos), found, expected)
        for check in _TEXT_CHECKS
        for pos, found, expected in check(pins, text)
    ]


def _messages(text: str) -> Iterator[tuple[int, str]]:
    """(first line, value) of each string literal of a Python source; adjacent literals are one value."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def _message_drift(pins: _Pins, rel: str, text: str) -> list[Drift]:
    return [
        Drift(rel, line + value.count("\n", 0, pos), found, expected)
        for line, value in _messages(text)
        for check in _MESSAGE_CHECKS
        for pos, found, expected in check(pins, value)
    ]


def find_drift(stack: Stack, root: Path, files: Iterable[Path] | None = None) -> list[Drift]:
    """All references in ``files`` (default: the scanned set and verl_npu's modules under ``root``) that disagree.

    A ``.py`` file under ``root/verl_npu`` is read for its messages, any other for its text.
    """
    pins = _Pins.of(stack)
    messages_root = root / MESSAGES
    drifts: list[Drift] = []
    for path in files if files is not None else [*scanned_files(root), *message_files(root)]:
        text = _read(path)
        if text is None:
            continue
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        if path.suffix == ".py" and path.is_relative_to(messages_root):
            drifts += _message_drift(pins, rel, text)
            continue
        drifts += _text_drift(pins, rel, text)
        chip = path.name.rsplit(".", 1)[-1] if path.name.startswith("Dockerfile.") else None
        if chip is not None:
            drifts += _dockerfile_drift(stack, rel, text, chip)
    return drifts


def _dockerfile_drift(stack: Stack, rel: str, text: str, chip: str) -> list[Drift]:
    if chip not in stack.chips:
        return [Drift(rel, 1, f"Dockerfile for chip {chip!r}", f"one of {', '.join(stack.chips)}")]
    want = stack.chips[chip]
    out = []
    froms = list(_FROM_RE.finditer(text))
    if not froms:
        out.append(Drift(rel, 1, "no FROM line", f"FROM {want.base_image}"))
    for m in froms:
        if m.group(1) != want.base_image:
            out.append(Drift(rel, _line_of(text, m.start()), f"FROM {m.group(1)}", f"FROM {want.base_image}"))
    for m in _SOC_RE.finditer(text):
        if m.group(1) != want.soc_version:
            out.append(Drift(rel, _line_of(text, m.start()), f"SOC_VERSION {m.group(1)}", want.soc_version))
    targets = list(_TARGET_RE.finditer(text))
    if not targets:
        out.append(Drift(rel, 1, "no `install.sh --target` line", f"RUN bash install.sh --target {chip}"))
    for m in targets:
        if m.group(1) != chip:
            out.append(Drift(rel, _line_of(text, m.start()), f"--target {m.group(1)}", f"--target {chip}"))
    return out
