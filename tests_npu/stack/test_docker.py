"""The A2/A3 Dockerfiles: hadolint-clean, identical but for per-chip values, no floating refs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_ascend import BASE_IMAGE_ENV, SOURCED_IN_ORDER, make_fake_ascend, sourced
from support.paths import REPO

from verl_npu.stack import load_stack

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


def _entrypoint(*command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "docker" / "entrypoint.sh"), *command],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        check=False,
    )


def test_entrypoint_sources_the_base_images_three_cann_scripts_in_order(tmp_path):
    """Like the CANN base image's own entrypoint, which ours replaces: the toolkit, then AscendNPU IR
    (from the ASCEND_TOOLKIT_HOME the toolkit sets), then ATB with --cxx_abi; then the command."""
    env = {**BASE_IMAGE_ENV, **make_fake_ascend(tmp_path / "Ascend")}
    done = _entrypoint(
        "bash",
        "-c",
        'echo "$ASCEND_TOOLKIT_HOME $FAKE_CANN_TOOLKIT $FAKE_CANN_ASCENDNPU_IR $FAKE_CANN_ATB_ARGS"',
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert sourced(env) == SOURCED_IN_ORDER
    assert done.stdout.split() == [str(tmp_path / "Ascend" / "cann-9.1.0"), "loaded", "loaded", "--cxx_abi=1"]
    assert done.stderr == ""

    env = {**env, "ATB_CXX_ABI": "0", "CANN_ENV_LOG": str(tmp_path / "abi0.log")}
    assert _entrypoint("true", env=env).returncode == 0
    assert sourced(env) == [*SOURCED_IN_ORDER[:2], "atb --cxx_abi=0"]


def test_entrypoint_warns_for_each_missing_cann_script_and_still_runs_the_command(tmp_path):
    env = make_fake_ascend(tmp_path / "Ascend", missing=("ascendnpu-ir", "atb"))
    done = _entrypoint("echo", "ran", env=env)
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert sourced(env) == ["toolkit"]
    assert "ascendnpu-ir/bin/set_env.sh not found: no AscendNPU IR" in done.stderr
    assert "nnal/atb/set_env.sh not found: no ATB" in done.stderr

    none = _entrypoint("true", env={"ASCEND_ROOT": str(tmp_path / "none")})
    assert none.returncode == 0
    assert none.stderr.count("[verl-npu entrypoint] WARNING:") == 3
    assert "CANN is not set up in this environment" in none.stderr


# vllm-ascend 0.23.0's CaMemAllocator (vllm_ascend/device_allocator/camem.py), the allocator of vLLM's
# sleep mode that verl uses by default, asserts that PYTORCH_NPU_ALLOC_CONF has no
# expandable_segments:True. An image that sets it cannot start verl's rollout.
_SETS_ALLOC_CONF = re.compile(r"^(?!\s*#).*\bPYTORCH_NPU_ALLOC_CONF(\s*=|\s+\S)", re.M)


@pytest.mark.parametrize(
    "path",
    [*DOCKERFILES.values(), REPO / "docker" / "entrypoint.sh", REPO / "docker" / "cann-env.sh"],
    ids=lambda p: p.name,
)
def test_image_leaves_pytorch_npu_alloc_conf_unset_for_vllm_ascend_sleep_mode(path):
    match = _SETS_ALLOC_CONF.search(path.read_text())
    assert match is None, (
        f"{path.name} sets {match.group(0).strip()!r}: vllm-ascend's CaMemAllocator (sleep mode, verl's default) "
        "asserts expandable_segments:True is not set"
    )


def _login_hook(shell: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """What a CI step's `bash -el` does with /etc/profile.d/verl-npu-cann.sh (a link to docker/profile-cann.sh)."""
    script = f'. "{REPO / "docker" / "profile-cann.sh"}"; echo "${{FAKE_CANN_TOOLKIT:-none}} ${{VERL_NPU_CANN_ENV:-}}"'
    return subprocess.run(
        [shell, "-e", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "VERL_NPU_SRC": str(REPO), **env},
        check=False,
    )


def test_a_login_shell_loads_cann_where_the_entrypoint_did_not_run(tmp_path):
    env = {**BASE_IMAGE_ENV, **make_fake_ascend(tmp_path / "Ascend")}
    done = _login_hook("bash", env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["loaded", "loaded"]
    assert sourced(env) == SOURCED_IN_ORDER

    # a shell the entrypoint started has it already: nothing is sourced twice
    again = {**env, "CANN_ENV_LOG": str(tmp_path / "again.log"), "VERL_NPU_CANN_ENV": "loaded"}
    assert _login_hook("bash", again).returncode == 0
    assert sourced(again) == []


@pytest.mark.skipif(shutil.which("sh") is None, reason="no POSIX sh on this machine")
def test_the_login_hook_leaves_a_non_bash_login_shell_alone(tmp_path):
    env = make_fake_ascend(tmp_path / "Ascend")
    done = _login_hook("sh", env)
    assert done.returncode == 0, done.stderr
    if Path(shutil.which("sh")).resolve().name != "bash":  # dash: the bash-only script is skipped
        assert sourced(env) == [] and done.stdout.split() == ["none"]


@pytest.mark.parametrize("chip", ["a2", "a3"])
def test_images_link_the_login_hook_into_profile_d(chip):
    text = DOCKERFILES[chip].read_text()
    assert "ln -s /opt/verl-npu/src/verl-npu/docker/profile-cann.sh /etc/profile.d/verl-npu-cann.sh" in text
