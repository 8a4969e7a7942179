"""Drift lint: every version, tag, commit or image named outside the manifest must equal it.

Scans the files people copy pins from (docker/, install.sh, ci/, examples/, README.md,
pyproject.toml) and reports each reference that disagrees with verl_npu/stack/stack.toml.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

from verl_npu.stack.manifest import Stack

SCANNED = ("docker", "install.sh", "ci", "examples", "README.md", "pyproject.toml", ".ci")
_TEXT_SUFFIXES = {"", ".sh", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".py", ".cfg", ".a2", ".a3"}
_SHA_RE = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{40}(?![0-9a-fA-F])")
_IMAGE_RE = re.compile(r"[a-z0-9.-]+\.[a-z]{2,}(?::\d+)?/[a-z0-9._/-]*cann:[A-Za-z0-9._-]+")
_FROM_RE = re.compile(r"^\s*FROM\s+(\S+)", re.M)
_SOC_RE = re.compile(r"SOC_VERSION[=: \"']+(ascend[0-9a-z_]+)")
_MEGATRON_REF_RE = re.compile(r"\bcore_[rv]\d+\.\d+\.\d+\b")
_PY_RE = re.compile(r"(?:\bpython|\bpy|Python )(3\.\d+)\b")
_CANN_RE = re.compile(r"(?i)\bcann[-: ]?(?:version[= ]+)?v?(\d+\.\d+\.\d+[A-Za-z0-9.]*)")
_TARGET_RE = re.compile(r"install\.sh\b[^\n]*--target[= ](a2|a3|dev)\b")


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


def _package_pattern(name: str) -> re.Pattern[str]:
    # torch-npu == torch_npu; a pin is NAME==X, NAME===X or NAME~=X (also inside quotes).
    loose = re.escape(name).replace(r"\-", "[-_]")
    return re.compile(rf"(?<![\w.-]){loose}\s*(===|==|~=)\s*v?([0-9][0-9A-Za-z.+]*)", re.I)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def find_drift(stack: Stack, root: Path, files: Iterable[Path] | None = None) -> list[Drift]:
    """All references in ``files`` (default: the scanned set under ``root``) that disagree."""
    drifts: list[Drift] = []
    versions = dict(stack.expected_versions("dev"))
    for target in ("a2", "a3"):
        versions.update(stack.expected_versions(target))
    commits = {g.commit: g.name for g in stack.git.values() if g.verified}
    refs = {g.ref for g in stack.git.values()}
    images = {c.base_image: c.name for c in stack.chips.values()}
    socs = {c.soc_version: c.name for c in stack.chips.values()}
    canns = {c.cann_version for c in stack.chips.values()}
    patterns = {name: _package_pattern(name) for name in versions}

    for path in files if files is not None else scanned_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

        def report(
            pos: int, found: str, expected: str, rel: str = rel, text: str = text, out: list[Drift] = drifts
        ) -> None:
            out.append(Drift(rel, _line_of(text, pos), found, expected))

        for name, pattern in patterns.items():
            for m in pattern.finditer(text):
                if m.group(2).split("+")[0] != versions[name]:
                    report(m.start(), m.group(0), f"{name}=={versions[name]}")
        for m in _SHA_RE.finditer(text):
            if m.group(0) not in commits:
                report(
                    m.start(),
                    f"commit {m.group(0)}",
                    f"one of the pinned commits ({', '.join(sorted(commits.values()))})",
                )
        for m in _IMAGE_RE.finditer(text):
            if m.group(0) not in images:
                report(m.start(), f"image {m.group(0)}", " or ".join(sorted(images)))
        for m in _SOC_RE.finditer(text):
            if m.group(1) not in socs:
                report(m.start(), f"SOC_VERSION {m.group(1)}", " or ".join(sorted(socs)))
        for m in _MEGATRON_REF_RE.finditer(text):
            if m.group(0) not in refs:
                report(
                    m.start(),
                    f"ref {m.group(0)}",
                    f"one of {', '.join(sorted(r for r in refs if r.startswith('core_')))}",
                )
        for m in _PY_RE.finditer(text):
            if m.group(1) != stack.python:
                report(m.start(), m.group(0), f"Python {stack.python}")
        for m in _CANN_RE.finditer(text):
            if m.group(1) not in canns:
                report(m.start(), m.group(0), f"CANN {' or '.join(sorted(canns))}")
        if "requires-python" in text:
            m = re.search(r'requires-python\s*=\s*"([^"]+)"', text)
            if m and f">={stack.python}" not in m.group(1):
                report(m.start(), m.group(0), f"requires-python starting at >={stack.python}")

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
