"""The build-manifest rules: what install.sh recorded against stack.toml and what is installed now."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from support.doctor_env import (
    DEV_MODULES,
    NPU_SMI_A3,
    STACK,
    a3_versions,
    dev_versions,
    make_probe,
    make_tree,
    only,
    write_build_manifest,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, WARN
from verl_npu.stack import REPO_ROOT, build_manifest


def test_build_manifest_absent_warns(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)])
    report = doctor.diagnose(probe, STACK)
    finding = only(report.findings, "build-manifest")
    assert finding.status == WARN
    assert "no build manifest" in finding.detail
    assert "install.sh --target dev" in finding.fix and build_manifest.ENV_VAR in finding.fix


def test_build_manifest_matching_is_ok(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "a3", verified=True)
    probe = make_probe([make_tree(tmp_path / "sp", a3_versions())], npu=NPU_SMI_A3, build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "a3", build_manifest.read(manifest))
    assert [f.check for f in findings] == ["build-manifest"]
    assert findings[0].status == OK
    assert str(manifest) in findings[0].detail and "target a3" in findings[0].detail
    assert f"mindspeed={STACK.git['mindspeed'].commit[:12]}" in findings[0].detail


def test_build_manifest_drift_fails(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "dev")
    tree = make_tree(tmp_path / "sp", dev_versions(torch="2.9.0", transformers="5.10.3"))
    probe = make_probe([tree], build_manifest_path=manifest)
    drift = only(
        doctor.check_build_manifest(probe, STACK, "dev", build_manifest.read(manifest)),
        "build-manifest.drift",
    )
    assert drift.status == FAIL
    assert "torch: built 2.10.0, now 2.9.0" in drift.detail
    assert "transformers: built 5.10.4, now 5.10.3" in drift.detail
    assert "verl:" not in drift.detail
    assert "rebuild" in drift.fix


def test_build_manifest_unverified_commits_warn(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "a3")  # as stack.toml pins them
    probe = make_probe([make_tree(tmp_path / "sp", a3_versions())], npu=NPU_SMI_A3, build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "a3", build_manifest.read(manifest))
    unverified = only(findings, "build-manifest.unverified")
    assert unverified.status == WARN
    for comp in STACK.git_for("a3"):
        commit = hashlib.sha1(comp.name.encode()).hexdigest()[:12] if not comp.verified else comp.commit[:12]
        assert (f"{comp.name}={commit}" in unverified.detail) is (not comp.verified), comp.name
    assert "stack.toml" in unverified.fix
    assert only(findings, "build-manifest").status == OK


def test_build_manifest_other_stack_warns(tmp_path: Path) -> None:
    manifest = write_build_manifest(tmp_path / "bm.json", "dev", sha="0" * 64)
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions())], build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "dev", build_manifest.read(manifest))
    stack = only(findings, "build-manifest.stack")
    assert stack.status == WARN
    assert str(manifest) in stack.detail and "different stack.toml" in stack.detail
    assert "rebuild" in stack.fix


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "not valid JSON"), ('{"target": "dev", "git": {}}', "key 'versions' is missing")],
)
def test_build_manifest_malformed_fails(tmp_path: Path, content: str, message: str) -> None:
    manifest = tmp_path / "build-manifest.json"
    manifest.write_text(content)
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)], build_manifest_path=manifest)
    report = doctor.diagnose(probe, STACK)
    finding = only(report.findings, "build-manifest")
    assert finding.status == FAIL
    assert str(manifest) in finding.detail and message in finding.detail
    assert "rerun install.sh" in finding.fix
    assert report.failed
    assert not [f for f in report.findings if f.check.startswith("build-manifest.")]


def test_build_manifest_named_but_missing_fails(tmp_path: Path) -> None:
    manifest = tmp_path / "nowhere" / "build-manifest.json"
    probe = make_probe([make_tree(tmp_path / "sp", dev_versions(), DEV_MODULES)], build_manifest_path=manifest)
    finding = only(doctor.diagnose(probe, STACK).findings, "build-manifest")
    assert finding.status == FAIL
    assert "not found" in finding.detail and build_manifest.ENV_VAR in finding.detail


def test_the_unverified_hint_names_stack_toml_where_it_is(tmp_path: Path) -> None:
    """The fix for unpinned commits names where the pins live: verl_npu/stack/stack.toml, not verl_npu/stack.toml."""
    manifest = write_build_manifest(tmp_path / "bm.json", "a3", verified=False)
    probe = make_probe([make_tree(tmp_path / "sp", a3_versions())], npu=NPU_SMI_A3, build_manifest_path=manifest)
    findings = doctor.check_build_manifest(probe, STACK, "a3", build_manifest.read(manifest))
    fix = only(findings, "build-manifest.unverified").fix
    named = fix.rsplit(" in ", 1)[1]
    assert named == "verl_npu/stack/stack.toml" and (REPO_ROOT / named).resolve() == STACK.path.resolve()


def test_a_build_manifest_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """VERL_NPU_BUILD_MANIFEST naming a FIFO hung doctor; /dev/zero ran the reader out of memory."""
    import os

    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device"), (tmp_path, "a directory")):
        with pytest.raises(build_manifest.BuildManifestError, match=f"cannot read the build manifest: .*{kind}"):
            build_manifest.read(path)
    assert build_manifest._main(["verify", "--target", "a3", "--path", "/dev/zero"]) == 1


def test_a_build_manifest_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "build-manifest.json"
    path.write_text('{"target": "a2", "target": "a3", "versions": {}, "git": {}}')
    with pytest.raises(build_manifest.BuildManifestError, match="'target' appears twice"):
        build_manifest.read(path)
