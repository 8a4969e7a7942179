"""install.sh: plan, argument errors, step naming, shellcheck, and idempotency on the real venv."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from support.doctor_env import (
    A2_CAPTURE,
    A2_X16_CAPTURE,
    A3_CAPTURE,
    A3_OLD_CAPTURE,
    UNKNOWN_CAPTURE,
    install_npu_smi,
)
from support.fake_ascend import BASE_IMAGE_ENV, SOURCED_IN_ORDER, make_fake_ascend, sourced
from support.paths import REPO
from support.pypi import sdist

from verl_npu.stack import load_stack
from verl_npu.stack.build_requires import build_requirements
from verl_npu.stack.plan import Step, install_plan


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
    lines = out.splitlines()

    def line_of(needle: str) -> int:
        (index,) = [i for i, line in enumerate(lines) if needle in line]
        return index

    # torch's companions from the same index right after it; vllm-ascend patched before its install;
    # upstream triton replaced by triton-ascend after every other third-party install.
    assert (
        line_of("pip       torch==") + 1 == line_of("pip       torchvision==") == line_of("pip       torchaudio==") - 1
    )
    for name in ("vllm-ascend", "mindspeed"):  # every patch, in the manifest's order (the order install.sh applies)
        assert f"+ patches {','.join(stack.git[name].patches)}" in lines[line_of(f" {name} ")]
    # vLLM builds against the stack's torch, not in an isolated environment holding its own
    skipped = " ".join(stack.git["vllm"].build_requires_skip)
    assert f"[no build isolation: its build requirements first, except {skipped}]" in lines[line_of(" vllm ")]
    replace = line_of("replace   triton-ascend==3.2.2")
    assert "uninstall triton if installed" in lines[replace] and "(index https://triton-ascend" in lines[replace]
    installs = [i for i, line in enumerate(lines) if re.match(r"\s*\d+\. (git|pip) ", line)]
    assert len(installs) == len(stack.packages_for("a3")) + len(stack.git_for("a3")) and max(installs) < replace
    assert replace + 1 == line_of("local     verl-npu")
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


def _with_npu_smi(tmp_path: Path, capture: str | None, *, fails: bool = False) -> dict[str, str]:
    """PATH with an npu-smi that prints a real capture for `npu-smi info` (``fails``: exits 8 as without
    the driver, printing nothing)."""
    stderr = "dcmi model initialized failed" if fails else ""
    bin_dir = install_npu_smi(tmp_path / "npu-bin", None if fails else capture, exit_code=8 if fails else 0,
                              stderr=stderr)  # fmt: skip
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    ("capture", "target"),
    [(A3_CAPTURE, "a3"), (A3_OLD_CAPTURE, "a3"), (A2_CAPTURE, "a2"), (A2_X16_CAPTURE, "a2")],
)
def test_detected_target_of_a_real_node(tmp_path, capture, target):
    """install.sh without --target died on A3 nodes: their npu-smi names the chip `Ascend910`."""
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env=_with_npu_smi(tmp_path, capture))
    assert done.returncode == 0, done.stderr
    assert f"no --target given; detected target: {target}" in done.stdout
    assert f"plan for target '{target}'" in done.stdout


@pytest.mark.parametrize(
    ("capture", "fails", "message"),
    [(UNKNOWN_CAPTURE, False, "npu-smi lists 310P3 chips: neither"), (None, True, "`npu-smi info` failed")],
)
def test_an_unknown_chip_or_a_failing_npu_smi_stops_detection(tmp_path, capture, fails, message):
    env = _with_npu_smi(tmp_path, capture, fails=fails)
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env=env)
    assert done.returncode != 0
    assert message in done.stderr and "--target a2 or --target a3" in done.stderr
    assert 'ERROR in step "detect target": the target could not be detected' in done.stderr
    assert not (tmp_path / "p").exists()


def test_detect_target_runs_on_the_standard_library_alone(tmp_path):
    """install.sh asks before anything is installed: `python -m verl_npu.stack detect-target` from the
    checkout, with no site-packages at all (-S), still answers."""
    env = {**os.environ, **_with_npu_smi(tmp_path, A3_CAPTURE)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-S", "-m", "verl_npu.stack", "detect-target"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "a3\n"), done.stderr


def test_npu_target_without_cann_fails_in_the_chip_step(tmp_path):
    env = {"ASCEND_ROOT": str(tmp_path / "no-ascend"), **BASE_IMAGE_ENV}
    done = run_install("--target", "a2", "--prefix", str(tmp_path / "p"), env=env)
    assert done.returncode != 0
    assert re.search(
        r'ERROR in step "2\. chip a2": CANN not found \(.*/no-ascend/ascend-toolkit/set_env\.sh\)', done.stderr
    ), done.stderr


def _install_until_the_first_pip_call(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `install.sh --target a2` with a python3.12 on PATH that is the real one until install.sh
    first asks it about or for a package (step 3): there it saves its environment and fails."""
    bin_dir, capture = tmp_path / "bin", tmp_path / "env-at-step-3.json"
    bin_dir.mkdir()
    fake = bin_dir / "python3.12"
    fake.write_text(
        "#!/bin/bash\n"
        'if [[ "$1" == -I || "$1 $2" == "-m pip" ]]; then\n'
        f"  {sys.executable} -c \"import json, os; json.dump(dict(os.environ), open('{capture}', 'w'))\"\n"
        "  exit 97\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    done = run_install(
        "--target", "a2", "--prefix", str(tmp_path / "prefix"),
        env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )  # fmt: skip
    return done, (json.loads(capture.read_text()) if capture.is_file() else {})


def test_chip_step_sources_the_three_cann_scripts_in_order_during_the_build(tmp_path):
    """The base image sets ASCEND_TOOLKIT_HOME, and the build still needs the toolkit's paths,
    AscendNPU IR (triton-ascend's compiler) and ATB: the chip step sources all three, as the image's
    entrypoint does (docker/cann-env.sh), and the next steps run inside that environment."""
    env = {**BASE_IMAGE_ENV, **make_fake_ascend(tmp_path / "Ascend")}
    done, seen = _install_until_the_first_pip_call(tmp_path, env)
    assert sourced(env) == SOURCED_IN_ORDER, done.stderr
    assert seen, f"install.sh stopped before step 3:\n{done.stderr}"
    assert seen["ASCEND_TOOLKIT_HOME"] == str(tmp_path / "Ascend" / "cann-9.1.0")
    assert (seen["FAKE_CANN_TOOLKIT"], seen["FAKE_CANN_ASCENDNPU_IR"]) == ("loaded", "loaded")
    assert seen["FAKE_CANN_ATB_ARGS"] == "--cxx_abi=1" and seen["SOC_VERSION"] == "ascend910b1"
    # CANN's scripts ran without -e/-u; afterwards install.sh's own error handling is back.
    assert re.search(r'ERROR in step "3\. pip torch": command at install\.sh:\d+ exited with status 97', done.stderr)
    assert "WARNING" not in done.stderr


def test_chip_step_warns_without_ascendnpu_ir_or_atb(tmp_path):
    env = {**BASE_IMAGE_ENV, **make_fake_ascend(tmp_path / "Ascend", missing=("ascendnpu-ir", "atb"))}
    done, seen = _install_until_the_first_pip_call(tmp_path, env)
    assert sourced(env) == ["toolkit"]
    assert seen["FAKE_CANN_TOOLKIT"] == "loaded", done.stderr
    assert "[install.sh] WARNING: " in done.stderr and "triton-ascend cannot compile kernels" in done.stderr
    assert "nnal/atb/set_env.sh not found" in done.stderr


def test_install_sh_and_the_entrypoint_share_one_cann_script_list():
    """The three scripts and their order are written once, in docker/cann-env.sh."""
    for path in (REPO / "install.sh", REPO / "docker" / "entrypoint.sh"):
        text = path.read_text()
        assert "docker/cann-env.sh" in text and "cann_env_load" in text, path.name
        for private in ("set_env.sh", "ascendnpu-ir", "nnal/atb", "cxx_abi"):
            assert private not in text, f"{path.name} names {private!r}: list CANN's scripts in docker/cann-env.sh only"


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


MADE_BY_INSTALL_SH = pytest.mark.skipif(
    not (Path(sys.prefix) / "build-manifest.json").is_file(),
    reason="this interpreter's environment was not made by install.sh (no build-manifest.json in sys.prefix)",
)


@MADE_BY_INSTALL_SH
def test_the_installed_environment_has_no_broken_requirements():
    """Every installed distribution's requirements hold (`pip check`): install.sh's steps run one pip install
    after another, and a step that moves a shared dependency past another's bound shows here."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@MADE_BY_INSTALL_SH
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


def _install_sh_functions(*names: str) -> str:
    """The named shell functions of install.sh, to run one step's code on its own."""
    lines = (REPO / "install.sh").read_text().splitlines()
    out = []
    for name in names:
        (start,) = [i for i, line in enumerate(lines) if line.startswith(f"{name}() {{")]
        # A one-line function ends on its own line; any other ends at the first line that is "}".
        end = start if "; }" in lines[start] else lines.index("}", start)
        out += lines[start : end + 1]
    return "\n".join(out)


def _wheel(directory: Path, dist: str, files: dict[str, str]) -> None:
    """A minimal pure-Python wheel (METADATA, WHEEL, RECORD) holding ``files``."""
    import zipfile

    info = f"{dist.replace('-', '_')}-1.0.dist-info"
    contents = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},," for path in contents] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(directory / f"{dist.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
        for path, text in contents.items():
            z.writestr(path, text)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


def test_replace_step_gives_the_shared_import_directory_back_to_its_package(tmp_path):
    """triton-ascend and upstream triton both install `triton/`: installing triton overwrites
    triton-ascend's files and uninstalling it deletes them. The replace step removes the intruder and
    reinstalls the owner (forced, no deps); run again, it changes nothing; it also repairs an owner
    whose files an uninstall deleted. Shown with two tiny wheels sharing `shared/`."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "vnpu-owner", {"shared/__init__.py": "WHO = 'owner'\n", "shared/owner_only.py": ""})
    _wheel(wheels, "vnpu-intruder", {"shared/__init__.py": "WHO = 'intruder'\n", "shared/intruder_only.py": ""})
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [str(py), "-m", "pip", "--quiet"]
    subprocess.run([*pip, "install", "vnpu-owner", "vnpu-intruder"], env=env, check=True)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("vnpu-owner==1.0\n")
    script = tmp_path / "replace.sh"
    script.write_text(
        "set -Eeuo pipefail\n"
        f"PY={py}; CONSTRAINTS_FILE={constraints}; ARCH=x86_64; STEP=test; REPO_ROOT={REPO}\nINDEX_ARGS=()\n"
        + _install_sh_functions(
            "log", "die", "field", "pip_install", "installed_version", "same_version", "set_index_args",
            "dist_intact", "run_replace_step",
        )
        + '\nrun_replace_step vnpu-owner "requirement=vnpu-owner==1.0|remove=vnpu-intruder"\n'
    )  # fmt: skip
    site = Path(subprocess.run([str(py), "-c", "import shared; print(shared.__path__[0])"], env=env,
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    assert (site / "__init__.py").read_text() == "WHO = 'intruder'\n"

    def replace() -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    done = replace()
    assert "uninstalling vnpu-intruder" in done.stdout
    assert (site / "__init__.py").read_text() == "WHO = 'owner'\n" and (site / "owner_only.py").is_file()
    assert not (site / "intruder_only.py").exists()
    freeze = [*pip, "freeze"]
    assert subprocess.run(freeze, env=env, capture_output=True, text=True).stdout.split() == ["vnpu-owner==1.0"]

    again = replace()
    assert "vnpu-owner 1.0 already installed with all its files" in again.stdout
    assert "Successfully installed" not in again.stdout

    # The intruder comes back and is uninstalled by hand: that deletes the owner's shared files too.
    subprocess.run([*pip, "install", "vnpu-intruder"], env=env, check=True)
    subprocess.run([*pip, "uninstall", "-y", "vnpu-intruder"], env=env, check=True)
    assert not (site / "__init__.py").exists()
    repaired = replace()
    assert "uninstalling" not in repaired.stdout, repaired.stdout
    assert "already installed" not in repaired.stdout, repaired.stdout
    assert (site / "__init__.py").read_text() == "WHO = 'owner'\n"


# install.sh's git step and what it calls (pip_install and installed_version are the test's own).
GIT_STEP_FUNCTIONS = (
    "log", "warn", "die", "field", "same_version", "git_nodiscover", "record_resolved", "apply_patches",
    "fetch_pinned_commit", "install_build_requirements", "run_git_step",
)  # fmt: skip


def test_git_step_applies_its_patches_before_installing_and_only_once(tmp_path):
    """A git component's patches (vllm-ascend's requirements.txt) are applied to the pinned checkout
    with `git apply --check` first, before `pip install -r requirements.txt`; a second run finds the
    component installed with them; a changed patch reinstalls from a clean checkout."""
    upstream, repo_root = tmp_path / "upstream", tmp_path / "verl-npu"
    upstream.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C"]
    (upstream / "requirements.txt").write_text("torch==2.10.0\ntransformers==5.5.4\nfastapi<0.124.0\n")
    subprocess.run([*git, str(upstream), "init", "-q"], check=True)
    subprocess.run([*git, str(upstream), "add", "."], check=True)
    subprocess.run([*git, str(upstream), "commit", "-qm", "pin"], check=True)
    commit = subprocess.run([*git, str(upstream), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (upstream / "requirements.txt").write_text("torch==2.10.0\nfastapi<0.124.0\n")
    patch = repo_root / "patches" / "comp" / "0001-drop-transformers.patch"
    patch.parent.mkdir(parents=True)
    diff = subprocess.run([*git, str(upstream), "diff"], capture_output=True, text=True, check=True).stdout
    patch.write_text("Drop the transformers pin.\n\n" + diff)
    subprocess.run([*git, str(upstream), "checkout", "-q", "requirements.txt"], check=True)

    log, seen = tmp_path / "pip.log", tmp_path / "requirements-at-install.txt"
    script = tmp_path / "git-step.sh"
    script.write_text(
        "set -Eeuo pipefail\n"
        f"REPO_ROOT={repo_root}; SRC_DIR={tmp_path / 'src'}; RESOLVED_FILE={tmp_path / 'resolved'}; STEP=test\n"
        + _install_sh_functions(*GIT_STEP_FUNCTIONS)
        + f'\npip_install() {{ echo "$*" >>{log}; if [[ $1 == -r ]]; then cp "$2" {seen}; fi; }}\n'
        + f'run_git_step comp "url={upstream}|ref=main|commit={commit}|install=vllm-ascend'
        + '|patches=patches/comp/0001-drop-transformers.patch"\n'
    )

    def step() -> str:
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    out = step()
    assert "applied patches/comp/0001-drop-transformers.patch" in out
    assert seen.read_text() == "torch==2.10.0\nfastapi<0.124.0\n", "pip saw the unpatched requirements"
    assert len(log.read_text().splitlines()) == 2  # -r requirements.txt, then the package itself

    again = step()
    assert "comp " + commit + " already installed with its patches" in again
    assert len(log.read_text().splitlines()) == 2

    patch.write_text(patch.read_text().replace("Drop the transformers pin.", "Drop it (reworded)."))
    changed = step()
    assert "applied patches/comp/0001-drop-transformers.patch" in changed and "already" not in changed
    assert len(log.read_text().splitlines()) == 4


# --- the git fetch, against local mirrors of each upstream ------------------------------------------

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main", "-C"]
# How each upstream publishes the manifest's ref: a release tag, or a branch that moves on after the pin.
UPSTREAM_REF_KIND = {
    "vllm": "tag", "vllm-ascend": "tag", "megatron-lm": "tag",
    "megatron-adaptor": "branch", "transformer-engine-npu": "branch", "mindspeed": "branch",
}  # fmt: skip


# The shape of vLLM's [build-system]: its own torch pin among the build tools.
PLACEHOLDER_PYPROJECT = """[build-system]
requires = ["cmake>=3.26.1", "ninja", "setuptools>=77.0.3,<81.0.0", "setuptools-scm>=8.0", "torch == 2.11.0", "wheel"]
build-backend = "setuptools.build_meta"
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _mirror(path: Path, ref: str, kind: str, tree: Path | None = None) -> str:
    """A local repository standing in for an upstream: ``tree`` (moved there) or a placeholder pyproject.toml
    committed, ``ref`` on that commit as upstream publishes it (an annotated tag, or a branch), then a later
    commit on top, as upstream's history goes on after a release. Returns the commit ``ref`` names (the pin)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if tree is None:
        path.mkdir()
        (path / "pyproject.toml").write_text(PLACEHOLDER_PYPROJECT)
    else:
        tree.rename(path)
    _git(path, "init", "-q")
    if kind == "branch":
        _git(path, "checkout", "-q", "-b", ref)
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "the pinned commit")
    pinned = _git(path, "rev-parse", "HEAD")
    if kind == "tag":
        _git(path, "tag", "-a", ref, "-m", f"release {ref}")
    (path / "LATER").write_text("after the pin\n")
    _git(path, "add", "LATER")
    _git(path, "commit", "-qm", "later work")
    return pinned


def _mirrors_env(mirrors: dict[str, Path]) -> dict[str, str]:
    """git configuration (environment only) that sends each upstream URL to its local mirror over file://,
    git's real transport (shallow fetches included), as `url.<base>.insteadOf` does."""
    env = {"GIT_CONFIG_COUNT": str(len(mirrors))}
    for i, (url, mirror) in enumerate(mirrors.items()):
        env[f"GIT_CONFIG_KEY_{i}"] = f"url.{mirror.as_uri()}.insteadOf"
        env[f"GIT_CONFIG_VALUE_{i}"] = url
    return env


def _git_step_script(tmp_path: Path, name: str, fields: str, fakes: str) -> Path:
    """install.sh's git step for one component (the plan line's fields), with ``fakes`` defining pip_install
    and installed_version: they stand in for pip acting on the image's Python."""
    script = tmp_path / f"git-step-{name}.sh"
    script.write_text(
        "set -Eeuo pipefail\n"
        f"REPO_ROOT={REPO}; BASE_PYTHON={sys.executable}; STEP=test\n"
        f"SRC_DIR={tmp_path / 'src'}; RESOLVED_FILE={tmp_path / 'resolved'}\n"
        + _install_sh_functions(*GIT_STEP_FUNCTIONS)
        + "\n"
        + fakes
        + f"\nrun_git_step {name} '{fields}'\n"
    )
    return script


def _plan_fields(name: str, target: str = "a3", **override: str) -> str:
    """The fields of the plan's git step for ``name`` as install.sh reads them, with ``override`` applied."""
    (step,) = [s for s in install_plan(load_stack(), target) if s.kind == "git" and s.name == name]
    return Step(step.kind, step.name, {**step.fields, **override}).line().split("|", 2)[2]


def test_git_step_fetches_each_component_at_its_pin_with_its_tag(tmp_path):
    """Every git component of the image, fetched by install.sh's git step from a mirror of its upstream,
    is checked out at the pin; where the manifest's ref is a tag, the tag comes along and names that
    commit (setuptools-scm computes vLLM's and vllm-ascend's versions from it: a checkout without it
    reports 0.1.devN). An UNVERIFIED component gets its ref's commit, resolved at build time."""
    stack = load_stack()
    components = stack.git_for("a3")
    assert set(UPSTREAM_REF_KIND) == {c.name for c in components}, "add the new component to UPSTREAM_REF_KIND"
    mirrors, pins = {}, {}
    for comp in components:
        mirror = tmp_path / "upstream" / comp.name
        pins[comp.name] = _mirror(mirror, comp.ref, UPSTREAM_REF_KIND[comp.name])
        mirrors[comp.url] = mirror
    env = {**os.environ, **_mirrors_env(mirrors)}
    # What is checked here is the checkout; pip is not run, and the install reports the pinned versions.
    versions = tmp_path / "versions"
    versions.write_text("".join(f"{dist} {version}\n" for dist, version in stack.expected_versions("a3").items()))
    pip_log = tmp_path / "pip.log"
    fakes = f'pip_install() {{ echo "VLLM_TARGET_DEVICE=${{VLLM_TARGET_DEVICE:-}} $*" >>{pip_log}; }}\n'
    fakes += 'installed_version() { sed -n "s/^$1 //p" ' + f"{versions}; }}\n"

    for comp in components:
        mirror = mirrors[comp.url]
        # The placeholder tree has nothing for a patch to apply to (test_patches.py applies them to the real sources).
        if comp.verified:
            fields = _plan_fields(comp.name, commit=pins[comp.name], patches="")
            expected = pins[comp.name]
        else:
            fields = _plan_fields(comp.name, patches="")
            ref = f"refs/heads/{comp.ref}" if UPSTREAM_REF_KIND[comp.name] == "branch" else f"{comp.ref}^{{commit}}"
            expected = _git(mirror, "rev-parse", ref)
        script = _git_step_script(tmp_path, comp.name, fields, fakes)
        pip_log.write_text("")
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{comp.name}: {done.stdout}{done.stderr}"
        checkout = tmp_path / "src" / comp.name
        if comp.name == "vllm":
            # vLLM's build requirements but its torch (and the compilers an empty-device build never runs)
            # first, then vLLM itself without an isolated build environment that would fetch torch 2.11.
            assert pip_log.read_text().splitlines() == [
                "VLLM_TARGET_DEVICE= setuptools>=77.0.3,<81.0.0 setuptools-scm>=8.0 wheel",
                f"VLLM_TARGET_DEVICE=empty --no-build-isolation -e {checkout}",
            ]
        assert _git(checkout, "rev-parse", "HEAD") == expected, comp.name
        if UPSTREAM_REF_KIND[comp.name] == "tag":
            assert _git(checkout, "describe", "--tags", "--exact-match") == comp.ref, comp.name
            assert _git(checkout, "rev-parse", f"{comp.ref}^{{commit}}") == expected
        else:
            assert _git(checkout, "tag") == "", f"{comp.name}: no tag was asked for"


# One PEP 517 hook of a source tree's build backend, run as pip runs it (in the tree, one process per hook;
# in this environment: what --no-build-isolation means): `HOOK DIRECTORY [METADATA]`, printing its answer.
BUILD_HOOK = """
import importlib, sys, tomllib
system = tomllib.load(open("pyproject.toml", "rb"))["build-system"]
backend = importlib.import_module(system["build-backend"])
hook, directory, *metadata = sys.argv[1:]
print(getattr(backend, hook)(directory, **({"metadata_directory": metadata[0]} if metadata else {})))
"""


@pytest.mark.network
def test_vllm_from_its_tagged_source_builds_as_the_manifest_version_with_the_stack_torch(tmp_path):
    """vLLM's real source (the PyPI sdist of the pin, committed and tagged as upstream tags it) through
    install.sh's git step: the fetch brings the tag; vLLM's build requirements, less torch and the compilers,
    are installed for real under the stack's constraints (into a directory standing in for the image's
    site-packages); then vLLM's own build backend runs as pip runs it with --no-build-isolation and
    VLLM_TARGET_DEVICE=empty, against this venv's torch (the stack's), with git alone on PATH. It computes
    vLLM's version from the tag (setuptools-scm, vLLM's pyproject config): 0.23.0 in `vllm.__version__`,
    0.23.0+empty in the metadata, which install.sh's own version check accepts. No torch was installed."""
    stack = load_stack()
    comp = stack.git["vllm"]
    source = tmp_path / "sdist"
    with tarfile.open(sdist("vllm", comp.version)) as tar:
        tar.extractall(source, filter="data")
    (tree,) = source.iterdir()
    # What the sdist adds to the repository's files: its metadata and the version file setuptools-scm wrote.
    shutil.rmtree(tree / "vllm.egg-info")
    (tree / "PKG-INFO").unlink()
    (tree / "vllm" / "_version.py").unlink()
    pinned = _mirror(tmp_path / "upstream" / "vllm", comp.ref, UPSTREAM_REF_KIND["vllm"], tree)

    site, log = tmp_path / "image-site-packages", tmp_path / "pip.log"
    metadata, wheels, tools = tmp_path / "metadata", tmp_path / "wheels", tmp_path / "tools"
    for directory in (metadata, wheels, tools):
        directory.mkdir()
    (tools / "git").symlink_to(shutil.which("git"))  # the build's PATH: git alone (no cmake, ninja nor cargo)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(stack.constraints("a3")) + "\n")
    # pip_install stands in for pip acting on the image's Python: the build requirements really installed
    # (into `site`), and for the editable install, pip's build without isolation (metadata, then the wheel).
    fakes = f"""
pip_install() {{
  echo "VLLM_TARGET_DEVICE=${{VLLM_TARGET_DEVICE:-}} $*" >>{log}
  if [[ " $* " != *" -e "* ]]; then
    {sys.executable} -m pip install --quiet --disable-pip-version-check --target {site} -c {constraints} "$@"
  elif [[ " $* " != *" --no-build-isolation "* ]]; then
    echo "pip would build vLLM in an isolated environment with its [build-system] torch" >&2; return 1
  else
    local hook=(env PATH={tools} PYTHONPATH={site} {sys.executable} -c '{BUILD_HOOK}') made
    made="$(cd "${{!#}}" && "${{hook[@]}}" prepare_metadata_for_build_editable {metadata} | tail -n 1)"
    (cd "${{!#}}" && "${{hook[@]}}" build_editable {wheels} "{metadata}/$made")
  fi
}}
installed_version() {{ [[ $1 == vllm ]] && sed -n 's/^Version: //p' {metadata}/*.dist-info/METADATA; }}
"""
    script = _git_step_script(tmp_path, "vllm", _plan_fields("vllm", commit=pinned), fakes)
    env = {**os.environ, **_mirrors_env({comp.url: tmp_path / "upstream" / "vllm"})}
    env.pop("VLLM_VERSION_OVERRIDE", None)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    (dist_info,) = metadata.glob("*.dist-info")
    version = HeaderParser().parse(io.StringIO((dist_info / "METADATA").read_text()))["Version"]
    assert version == f"{comp.version}+empty", version  # VLLM_TARGET_DEVICE=empty's local label, as vLLM names it
    assert [w.name.split("-")[1] for w in wheels.glob("vllm-*.editable-*.whl")] == [version]
    checkout = tmp_path / "src" / "vllm"
    # What `vllm.__version__` reads at run time (vllm/version.py imports it): the release itself, which
    # vllm-ascend's vllm_version_is("0.23.0") compares equal (as packaging Versions, so a local label would not).
    spec = importlib.util.spec_from_file_location("built_vllm_version", checkout / "vllm" / "_version.py")
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    assert written.__version__ == comp.version
    requirements = build_requirements(checkout / "pyproject.toml", comp.build_requires_skip)
    assert log.read_text().splitlines() == [
        "VLLM_TARGET_DEVICE= " + " ".join(requirements),
        f"VLLM_TARGET_DEVICE=empty --no-build-isolation -e {checkout}",
    ]
    assert any(r.startswith("setuptools-scm") for r in requirements)
    assert not list(site.glob("torch*")), "a torch was installed for vLLM's build"


def _vllm_step(tmp_path: Path, commit: str) -> tuple[Path, dict[str, str], Path]:
    """install.sh's vllm step against a placeholder mirror (tag at ``_mirror``'s pin) and a recording pip."""
    comp = load_stack().git["vllm"]
    log = tmp_path / "pip.log"
    log.touch()
    fakes = f'pip_install() {{ echo "$*" >>{log}; }}\ninstalled_version() {{ echo {comp.version}; }}\n'
    script = _git_step_script(tmp_path, "vllm", _plan_fields("vllm", commit=commit), fakes)
    return script, {**os.environ, **_mirrors_env({comp.url: tmp_path / "upstream" / "vllm"})}, log


def test_a_tag_that_is_not_the_pinned_commit_stops_the_git_step(tmp_path):
    """The manifest's ref is a tag upstream, and the tag names another commit than the pin: one of the two is
    wrong, and the step stops naming both before anything is installed."""
    comp = load_stack().git["vllm"]
    tagged = _mirror(tmp_path / "upstream" / "vllm", comp.ref, "tag")
    later = _git(tmp_path / "upstream" / "vllm", "rev-parse", "HEAD")
    script, env, log = _vllm_step(tmp_path, later)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert (
        f"vllm: tag '{comp.ref}' of {comp.url} is commit {tagged}, but verl_npu/stack/stack.toml pins {later}"
        in done.stderr
    ), done.stderr
    assert log.read_text() == ""


def test_git_step_gets_the_tag_from_a_server_that_refuses_a_fetch_by_commit(tmp_path):
    """Git's protocol v0 refuses to send a commit no ref advertises: the step fetches the ref instead, and
    the checkout is still the pin with its tag."""
    ref = load_stack().git["vllm"].ref
    pinned = _mirror(tmp_path / "upstream" / "vllm", ref, "tag")
    script, env, log = _vllm_step(tmp_path, pinned)
    assert log.read_text() == ""
    count = int(env["GIT_CONFIG_COUNT"])
    env.update({"GIT_CONFIG_COUNT": str(count + 1), f"GIT_CONFIG_KEY_{count}": "protocol.version"})
    env[f"GIT_CONFIG_VALUE_{count}"] = "0"
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the server refused a fetch by commit; fetching '{ref}' instead" in done.stdout
    checkout = tmp_path / "src" / "vllm"
    assert _git(checkout, "rev-parse", "HEAD") == pinned
    assert _git(checkout, "describe", "--tags", "--exact-match") == ref
    assert len(log.read_text().splitlines()) == 2  # then installed: its build requirements, then vLLM


def test_git_step_fetches_again_a_checkout_made_without_its_tag(tmp_path):
    """A checkout at the pinned commit that an older install.sh fetched without the tag (vLLM then installed as
    0.1.devN) is fetched again, tag included, and reinstalled; after that a run changes nothing."""
    pinned = _mirror(tmp_path / "upstream" / "vllm", load_stack().git["vllm"].ref, "tag")
    script, env, log = _vllm_step(tmp_path, pinned)

    def step() -> str:
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    step()
    checkout = tmp_path / "src" / "vllm"
    assert len(log.read_text().splitlines()) == 2  # its build requirements, then vLLM
    # what the older install.sh left: the commit and the install stamp, no tag, no record of the fetch
    _git(checkout, "tag", "-d", load_stack().git["vllm"].ref)
    (checkout / ".git" / "verl-npu-fetched").unlink()
    step()
    assert _git(checkout, "describe", "--tags", "--exact-match") == load_stack().git["vllm"].ref
    assert len(log.read_text().splitlines()) == 4
    assert f"vllm {pinned} already installed" in step()
    assert len(log.read_text().splitlines()) == 4


@pytest.mark.parametrize(
    ("skip", "pyproject", "expected"),
    [
        ("torch,Ninja,CMAKE", PLACEHOLDER_PYPROJECT, ["setuptools>=77.0.3,<81.0.0", "setuptools-scm>=8.0", "wheel"]),
        ("torch,Setuptools_SCM", PLACEHOLDER_PYPROJECT,
         ["cmake>=3.26.1", "ninja", "setuptools>=77.0.3,<81.0.0", "wheel"]),
        ("torch,jinja2", PLACEHOLDER_PYPROJECT,
         "[build-system] requires does not list jinja2, which the manifest's build_requires_skip leaves out"),
        ("", "[project]\nname = 'x'\n", "[build-system] key 'requires' is missing or not a list of strings"),
        ("", "[build-system\n", "not a valid TOML file"),
        ("", None, "cannot read it (No such file or directory); a build without isolation needs its [build-system]"),
    ],
)  # fmt: skip
def test_build_requires_lists_the_checkouts_build_system_or_says_what_is_wrong(tmp_path, skip, pyproject, expected):
    """What install.sh reads for a build without isolation: `python -m verl_npu.stack build-requires`."""
    path = tmp_path / "pyproject.toml"
    if pyproject is not None:
        path.write_text(pyproject)
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.stack", "build-requires", str(path), "--skip", skip],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    if isinstance(expected, list):
        assert (done.returncode, done.stdout.splitlines()) == (0, expected), done.stderr
    else:
        assert done.returncode == 2 and done.stderr.startswith(f"error: {path}: "), done.stderr
        assert expected in done.stderr


# --- issue 29: a bad option or variable is exit 2, never a silent fallback ------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", ""], "--target is empty; valid targets: a2 a3 dev"),
        (["--target="], "--target is empty; valid targets: a2 a3 dev"),
        (["--target", "A3"], "unknown target 'A3'; valid targets: a2 a3 dev"),
        (["--target=a3 "], "unknown target 'a3 '; valid targets: a2 a3 dev"),
        (["--target", "a2 a3"], "unknown target 'a2 a3'; valid targets: a2 a3 dev"),
        (["--target", "a2", "--target=a3"], "--target is given twice ('a2', then 'a3'): give it once"),
        (["--prefix", ""], "--prefix is empty; give a directory"),
        (["--prefix=/tmp/a", "--prefix", "/tmp/b"], "--prefix is given twice ('/tmp/a', then '/tmp/b')"),
        (["--prefx", "/tmp/x"], "unknown argument '--prefx'"),
        (["--target"], "--target needs a value (one of: a2 a3 dev)"),
        (["--prefix", "--dev"], "--prefix needs a directory"),
    ],
)
def test_a_bad_option_is_exit_2_naming_it_before_anything(tmp_path, args, message):
    """`--target ''` used to fall back to detection, and a second --target to win silently."""
    bin_dir = install_npu_smi(tmp_path / "npu-bin", A3_CAPTURE)  # a detection would answer a3: it must not run
    done = run_install(*args, "--dry-run", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "detected target" not in done.stdout
    assert "plan for target" not in done.stdout


@pytest.mark.parametrize("value", ["A3", "a3 ", "Dev", "a4", "\uff41\uff13"])
def test_verl_npu_target_that_the_runtime_would_refuse_is_exit_2(tmp_path, value):
    """VERL_NPU_TARGET=A3 used to be ignored for detection; the runtime layer then refuses it at `import verl`."""
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env={"VERL_NPU_TARGET": value})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"VERL_NPU_TARGET='{value}' is not a target; valid targets: a2 a3 dev (lower case), or unset it" in (
        done.stderr
    )
    assert "plan for target" not in done.stdout


def test_verl_npu_target_is_the_target_without_an_option_and_empty_means_unset(tmp_path):
    bin_dir = install_npu_smi(tmp_path / "npu-bin", A2_CAPTURE)  # detection would say a2
    path = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env={**path, "VERL_NPU_TARGET": "a3"})
    assert done.returncode == 0, done.stderr
    assert "no --target given; target from VERL_NPU_TARGET: a3" in done.stdout and "plan for target 'a3'" in done.stdout
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env={**path, "VERL_NPU_TARGET": ""})
    assert done.returncode == 0, done.stderr
    assert "no --target given; detected target: a2" in done.stdout
    done = run_install("--target", "a2", "--dry-run", "--prefix", str(tmp_path / "p"), env={"VERL_NPU_TARGET": "a3"})
    assert done.returncode == 0, done.stderr
    assert "--target a2 differs from VERL_NPU_TARGET=a3" in done.stderr and "plan for target 'a2'" in done.stdout


@pytest.mark.parametrize("value", ["\u0661\u0662\u0660", "\uff11\uff12\uff10", "\u00b2", "1_0", "0", "120 ", "0x10"])
def test_the_detection_timeout_takes_ascii_seconds_only(tmp_path, value):
    """Under a UTF-8 locale too: install.sh's test spells out its digits rather than trusting a [0-9] range."""
    env = {"VERL_NPU_DETECT_TIMEOUT_S": value, "LC_ALL": "C.UTF-8"}
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"VERL_NPU_DETECT_TIMEOUT_S='{value}' is not a whole number of seconds from 1 to 99999" in done.stderr


def test_a_bad_probe_timeout_during_detection_is_exit_2(tmp_path):
    bin_dir = install_npu_smi(tmp_path / "npu-bin", A3_CAPTURE)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "VERL_NPU_PROBE_TIMEOUT_S": "\u0663\u0660"}
    done = run_install("--dry-run", "--prefix", str(tmp_path / "p"), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "VERL_NPU_PROBE_TIMEOUT_S='\u0663\u0660': expected a finite number" in done.stderr
    assert "the target detection refused its settings (message above)" in done.stderr
