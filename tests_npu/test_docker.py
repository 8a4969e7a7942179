"""The A2/A3 Dockerfiles: hadolint-clean, identical but for per-chip values, no floating refs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_npu.stack import load_stack

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = {chip: REPO / "docker" / f"Dockerfile.{chip}" for chip in ("a2", "a3")}


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.fail(f"{name} is not installed; run: bash install.sh --dev")
    return found


def test_dockerfiles_are_hadolint_clean():
    done = subprocess.run(
        [_tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), *map(str, DOCKERFILES.values())],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _normalised(chip: str) -> str:
    """The Dockerfile with this chip's declared values replaced by placeholders."""
    values = load_stack().chips[chip]
    text = DOCKERFILES[chip].read_text()
    for value, placeholder in (
        (values.base_image, "<base_image>"),
        (values.soc_version, "<soc_version>"),
        (values.description, "<description>"),
    ):
        assert value in text, f"Dockerfile.{chip} does not contain its declared {placeholder} {value!r}"
        text = text.replace(value, placeholder)
    return re.sub(rf"\b{chip}\b", "<chip>", text)


def test_a2_and_a3_differ_only_in_declared_per_chip_values():
    a2, a3 = _normalised("a2"), _normalised("a3")
    if a2 != a3:
        import difflib

        diff = "\n".join(
            difflib.unified_diff(a2.splitlines(), a3.splitlines(), "Dockerfile.a2", "Dockerfile.a3", lineterm="")
        )
        pytest.fail(f"Dockerfile.a2 and Dockerfile.a3 differ beyond the per-chip values:\n{diff}")


@pytest.mark.parametrize("chip", ["a2", "a3"])
def test_image_installs_with_install_sh_and_loads_the_layer(chip):
    text = DOCKERFILES[chip].read_text()
    assert re.search(rf"^FROM {re.escape(load_stack().chips[chip].base_image)}$", text, re.M)
    assert f"RUN bash install.sh --target {chip} --prefix /opt/verl-npu" in text
    assert "VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor" in text
    assert "VERL_NPU_BUILD_MANIFEST=/opt/verl-npu/build-manifest.json" in text
    assert 'ENTRYPOINT ["/opt/verl-npu/src/verl-npu/docker/entrypoint.sh"]' in text
    assert (REPO / "docker" / "entrypoint.sh").stat().st_mode & 0o111, "entrypoint.sh must be executable"


FORBIDDEN = [
    (r":latest\b", "floating image tag"),
    (r"@(main|master)\b", "floating git ref"),
    (r"git clone[^\n]*(--branch|-b)\s", "branch clone"),
    (r"\bsed\s+-i\b", "sed on files (use patches/)"),
    (r"curl[^\n|]*\|\s*(ba)?sh", "curl | bash"),
    (r"wget[^\n|]*\|\s*(ba)?sh", "wget | sh"),
]


@pytest.mark.parametrize(
    "path", [*DOCKERFILES.values(), REPO / "install.sh", REPO / "docker" / "entrypoint.sh"], ids=lambda p: p.name
)
def test_no_floating_refs_sed_or_pipe_to_shell(path):
    text = path.read_text()
    for pattern, what in FORBIDDEN:
        match = re.search(pattern, text)
        assert match is None, f"{path.name}: {what}: {match.group(0)!r}"


def test_entrypoint_sources_cann_and_runs_the_command(tmp_path):
    ascend = tmp_path / "Ascend"
    (ascend / "ascend-toolkit").mkdir(parents=True)
    (ascend / "nnal" / "atb").mkdir(parents=True)
    (ascend / "ascend-toolkit" / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=/fake/toolkit\n")
    (ascend / "nnal" / "atb" / "set_env.sh").write_text("export ATB_HOME_PATH=/fake/atb\n")
    done = subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), "bash", "-c", 'echo "$ASCEND_TOOLKIT_HOME $ATB_HOME_PATH"'],
        capture_output=True,
        text=True,
        env={"ASCEND_ROOT": str(ascend), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "/fake/toolkit /fake/atb"
    missing = subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), "true"],
        capture_output=True,
        text=True,
        env={"ASCEND_ROOT": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert missing.returncode == 0 and "CANN is not set up in this container" in missing.stderr
