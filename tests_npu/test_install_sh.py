"""install.sh: plan, argument errors, step naming, shellcheck, and idempotency on the real venv."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_npu.stack import load_stack

REPO = Path(__file__).resolve().parent.parent


def run_install(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(cwd / "install.sh"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=600,
        check=False,
    )


def test_a3_dry_run_prints_every_pin_in_order_and_touches_nothing(tmp_path):
    prefix = tmp_path / "prefix"
    done = run_install("--target", "a3", "--dry-run", "--prefix", str(prefix))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    stack = load_stack()
    for comp in stack.git_for("a3"):
        assert comp.url in out
        assert comp.commit in out, f"{comp.name}: {comp.commit} missing from the plan"
    for pkg in stack.packages_for("a3"):
        assert pkg.requirement in out
    assert stack.chips["a3"].base_image in out and "SOC_VERSION=ascend910_9392" in out
    positions = [out.index(f" {name} ") for name in ("megatron-adaptor", "transformer-engine-npu", "mindspeed")]
    assert positions == sorted(positions), "MegatronAdaptor -> TransformerEngineNPU -> MindSpeed order broken"
    assert "UNVERIFIED (resolved from 'core_r0.18.0' at build time" in out
    assert "dry run: nothing was installed or changed" in out
    assert not prefix.exists()


def test_unknown_target_lists_the_valid_ones():
    done = run_install("--target", "bogus", "--dry-run")
    assert done.returncode != 0
    assert "unknown target 'bogus'; valid targets: a2 a3 dev" in done.stderr


def test_unknown_argument_and_missing_value_are_named():
    done = run_install("--prefx", "/tmp/x")
    assert done.returncode != 0 and "unknown argument '--prefx'" in done.stderr
    done = run_install("--target")
    assert done.returncode != 0 and "--target needs a value" in done.stderr


def test_missing_python_gives_a_clear_message(tmp_path):
    """With no Python 3.12 on PATH nor under pyenv, the installer says how to get one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "dirname", "uname", "grep", "cat", "tr"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    done = run_install(
        "--target",
        "dev",
        "--dry-run",
        env={"PATH": str(bin_dir), "PYENV_ROOT": str(tmp_path / "pyenv"), "HOME": str(tmp_path)},
    )
    assert done.returncode != 0
    assert 'ERROR in step "find Python": Python 3.12 not found on PATH nor under pyenv' in done.stderr
    assert "pyenv install 3.12" in done.stderr


def test_a_broken_manifest_fails_in_the_named_step(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__"))
    manifest = copy / "verl_npu" / "stack" / "stack.toml"
    manifest.write_text(manifest.read_text().replace('version = "0.9.1"', 'version = "0.9.x"'))
    done = run_install("--target", "dev", "--dry-run", cwd=copy)
    assert done.returncode != 0
    assert "[packages.verl] key 'version' is not a PEP 440 version: '0.9.x'" in done.stderr
    assert 'ERROR in step "read manifest"' in done.stderr


def test_npu_target_without_cann_fails_in_the_chip_step(tmp_path):
    if Path("/usr/local/Ascend/ascend-toolkit/set_env.sh").exists():
        pytest.skip("CANN is installed here; this test proves the error on a machine without it")
    done = run_install("--target", "a2", "--prefix", str(tmp_path / "p"), env={"ASCEND_TOOLKIT_HOME": ""})
    assert done.returncode != 0
    assert re.search(r'ERROR in step "2\. chip a2": CANN not found', done.stderr), done.stderr


def test_shell_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    scripts = [
        REPO / "install.sh",
        REPO / ".ci" / "run",
        *sorted((REPO / "docker").glob("*.sh")),
        *sorted((REPO / "examples").rglob("*.sh")),
        *sorted((REPO / "ci").rglob("*.sh")),
    ]
    done = subprocess.run(
        [shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(
    not (Path(sys.prefix) / "build-manifest.json").is_file(),
    reason="this interpreter's environment was not made by install.sh (no build-manifest.json in sys.prefix)",
)
def test_second_install_changes_nothing():
    prefix = Path(sys.prefix)
    manifest = prefix / "build-manifest.json"
    before_manifest = manifest.read_bytes()
    freeze = [sys.executable, "-m", "pip", "freeze", "--all"]
    before = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    built = json.loads(before_manifest)
    done = run_install("--target", built["target"], "--prefix", str(prefix), "--dev")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Successfully installed" not in done.stdout
    assert "already installed" in done.stdout
    assert manifest.read_bytes() == before_manifest
    assert subprocess.run(freeze, capture_output=True, text=True, check=True).stdout == before


@pytest.mark.network
def test_a_failing_install_step_is_named(tmp_path):
    """A pin pip cannot satisfy stops the install with the step's number and name."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__"))
    manifest = copy / "verl_npu" / "stack" / "stack.toml"
    manifest.write_text(
        manifest.read_text().replace('[packages.torch]\nversion = "2.10.0"', '[packages.torch]\nversion = "0.0.1"')
    )
    done = run_install("--target", "dev", "--prefix", str(tmp_path / "venv"), cwd=copy)
    assert done.returncode != 0
    assert re.search(r'ERROR in step "2\. pip torch": command at install\.sh:\d+ exited with status 1', done.stderr), (
        done.stderr[-2000:]
    )
    assert not (tmp_path / "venv" / "build-manifest.json").exists()
