"""Stack rules: the build manifest install.sh wrote, against stack.toml and what is installed now."""

from __future__ import annotations

import hashlib

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import Stack, build_manifest

MANIFEST_IN_REPO = "verl_npu/stack/stack.toml"  # where the pins live in a checkout (install.sh reads it there)


def read_built(probe: Probe) -> tuple[dict | None, list[Finding]]:
    """The build manifest the probe names, or None and (for an unreadable one) the failure."""
    if probe.build_manifest_path is None:
        return None, []
    try:
        return build_manifest.read(probe.build_manifest_path), []
    except build_manifest.BuildManifestError as exc:
        return None, [Finding("build-manifest", FAIL, str(exc), "rerun install.sh")]


def check_build_manifest(probe: Probe, stack: Stack, target: str, built: dict | None) -> list[Finding]:
    path = probe.build_manifest_path
    if built is None:
        return [
            Finding(
                "build-manifest",
                WARN,
                "no build manifest found (this environment was not installed by install.sh)",
                f"bash install.sh --target {target}, or set {build_manifest.ENV_VAR} to the image's file",
            )
        ]
    findings = []
    current_sha = hashlib.sha256(stack.path.read_bytes()).hexdigest()
    if built.get("stack_manifest_sha256") != current_sha:
        findings.append(
            Finding(
                "build-manifest.stack",
                WARN,
                f"{path} was built from a different stack.toml than the installed verl_npu carries",
                "rebuild the image (or rerun install.sh) from this checkout",
            )
        )
    drifted = []
    for dist, record in sorted(built.get("versions", {}).items()):
        now = probe.version(dist)
        if now is not None and record.get("installed") and now != record["installed"]:
            drifted.append(f"{dist}: built {record['installed']}, now {now}")
    if drifted:
        findings.append(
            Finding(
                "build-manifest.drift",
                FAIL,
                "packages changed after the build: " + "; ".join(drifted),
                "do not pip install over the image; rebuild it or rerun install.sh",
            )
        )
    unverified = [
        f"{name}={rec['resolved_commit'][:12]}"
        for name, rec in sorted(built.get("git", {}).items())
        if not rec.get("verified")
    ]
    if unverified:
        findings.append(
            Finding(
                "build-manifest.unverified",
                WARN,
                "commits resolved at build time, not pinned: " + ", ".join(unverified),
                f"review them and pin them in {MANIFEST_IN_REPO}",
            )
        )
    git_lines = ", ".join(f"{n}={r['resolved_commit'][:12]}" for n, r in sorted(built.get("git", {}).items()))
    findings.insert(
        0,
        Finding(
            "build-manifest",
            OK,
            f"{path}: target {built['target']}, built {built.get('built_at', '?')}"
            + (f"; {git_lines}" if git_lines else ""),
        ),
    )
    return findings
