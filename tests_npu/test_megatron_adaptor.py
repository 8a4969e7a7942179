"""The runtime layer's first step: `import verl` checks the installed stack against the manifest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verl_npu import megatron_adaptor
from verl_npu.stack import build_manifest

LAYER = "verl_npu.megatron_adaptor"


def import_verl(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_NPU_", "VERL_USE_EXTERNAL"))}
    return subprocess.run(
        [sys.executable, "-c", f"import sys, verl; print({LAYER!r} in sys.modules)"],
        capture_output=True,
        text=True,
        env={**clean, "VERL_USE_EXTERNAL_MODULES": LAYER, **env},
        timeout=300,
        check=False,
    )


def test_import_verl_loads_the_layer_through_external_modules():
    done = import_verl()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_import_verl_fails_loudly_on_a_stack_mismatch():
    """This dev venv has no torch_npu: checked as an A3 node, `import verl` must refuse to go on."""
    done = import_verl(VERL_NPU_TARGET="a3")
    assert done.returncode != 0
    assert "StackMismatchError" in done.stderr
    assert "torch-npu: expected 2.10.0.post4, found not installed" in done.stderr
    assert "bash install.sh --target a3" in done.stderr


def test_escape_hatch_turns_the_mismatch_into_a_warning():
    done = import_verl(VERL_NPU_TARGET="a3", VERL_NPU_ALLOW_MISMATCH="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RuntimeWarning" in done.stderr and "torch-npu: expected 2.10.0.post4" in done.stderr


def test_check_stack_names_expected_and_found(monkeypatch):
    real = build_manifest.installed_version
    monkeypatch.setattr(build_manifest, "installed_version", lambda d: "2.9.0" if d == "torch" else real(d))
    monkeypatch.setenv("VERL_NPU_TARGET", "dev")
    monkeypatch.delenv(megatron_adaptor.ALLOW_MISMATCH_ENV, raising=False)
    with pytest.raises(megatron_adaptor.StackMismatchError, match=r"torch: expected 2\.10\.0, found 2\.9\.0"):
        megatron_adaptor.check_stack()
    monkeypatch.setenv(megatron_adaptor.ALLOW_MISMATCH_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"torch: expected 2\.10\.0, found 2\.9\.0"):
        assert megatron_adaptor.check_stack() == ["torch: expected 2.10.0, found 2.9.0"]


def test_unknown_target_is_named(monkeypatch):
    monkeypatch.setenv("VERL_NPU_TARGET", "a9")
    with pytest.raises(megatron_adaptor.StackMismatchError, match="VERL_NPU_TARGET='a9' is not a target"):
        megatron_adaptor.check_stack()
