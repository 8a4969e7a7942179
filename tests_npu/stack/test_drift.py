"""Drift lint: every pin named outside the manifest equals the manifest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.stack import load_stack
from verl_npu.stack.drift import README_PAGES, SCANNED, find_drift, scanned_files


def test_repository_has_no_drift():
    drifts = find_drift(load_stack(), REPO)
    assert not drifts, "files disagree with verl_npu/stack/stack.toml:\n" + "\n".join(map(str, drifts))


def test_every_scanned_path_exists_and_readmes_detail_pages_are_scanned():
    # a docs page renamed or a folder moved would otherwise drop out of the lint without a word
    assert [entry for entry in SCANNED if not (REPO / entry).exists()] == []
    scanned = {path.relative_to(REPO).as_posix() for path in scanned_files(REPO)}
    assert set(README_PAGES) <= scanned and "README.md" in scanned and "CONTRIBUTING.md" in scanned


def test_drift_lint_scans_the_files_people_copy_pins_from():
    names = {str(p.relative_to(REPO)) for p in scanned_files(REPO)}
    for expected in (
        "docker/Dockerfile.a2",
        "docker/Dockerfile.a3",
        "install.sh",
        "README.md",
        "pyproject.toml",
        "examples/glm5_2/run_glm5_2_grpo_a3.sh",
        ".ci/run",
    ):
        assert expected in names


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", "bench"))
    return copy


@pytest.mark.parametrize(
    ("old", "new", "must_name"),
    [
        ('[packages.verl]\nversion = "0.9.1"', '[packages.verl]\nversion = "0.9.2"', "pyproject.toml"),
        (
            '[packages.transformers]\nversion = "5.10.4"',
            '[packages.transformers]\nversion = "5.10.5"',
            "pyproject.toml",
        ),
        ("cann:9.1.0-a3-ubuntu22.04-py3.12", "cann:9.2.0-a3-ubuntu22.04-py3.12", "docker/Dockerfile.a3"),
        ('soc_version = "ascend910b1"', 'soc_version = "ascend910b2"', "docker/Dockerfile.a2"),
        (
            'commit = "ba7b5ebce12af60627a80985792a1449ce45f46c"',
            'commit = "0000000000000000000000000000000000000001"',
            "README.md",
        ),
        ('[python]\nversion = "3.12"', '[python]\nversion = "3.13"', "docker/Dockerfile.a2"),
    ],
)
def test_changing_one_pin_only_in_the_manifest_is_caught(repo_copy, old, new, must_name):
    manifest = repo_copy / "verl_npu" / "stack" / "stack.toml"
    text = manifest.read_text()
    assert old in text
    manifest.write_text(text.replace(old, new, 1))
    drifts = find_drift(load_stack(manifest), repo_copy)
    assert drifts, f"changing {old!r} -> {new!r} only in the manifest went unnoticed"
    assert must_name in {d.path for d in drifts}, [str(d) for d in drifts]


@pytest.mark.parametrize(
    ("path", "line", "expected"),
    [
        ("install.sh", "pip install torch-npu==2.11.0\n", "torch-npu==2.10.0.post4"),
        ("examples/x.sh", "pip install 'megatron_core==0.17.0'\n", "megatron-core==0.18.0"),
        (
            "ci/job.yaml",
            "image: swr.cn-south-1.myhuaweicloud.com/ascendhub/cann:8.5.0-a3-ubuntu22.04-py3.11\n",
            "cann:9.1.0",
        ),
        ("README.md", "git checkout 285068c8108e0e8e6538f54fe27c3ee86c5217a2\n", "pinned commits"),
        ("README.md", "git clone -b core_r0.17.0 https://gitcode.com/Ascend/MindSpeed.git\n", "core_r0.18.0"),
        ("docker/Dockerfile.a2", "ENV SOC_VERSION=ascend910_9392\n", "ascend910b1"),
    ],
)
def test_a_stale_reference_in_any_scanned_file_is_reported(repo_copy, path, line, expected):
    target = repo_copy / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text((target.read_text() if target.exists() else "") + line)
    drifts = [d for d in find_drift(load_stack(), repo_copy) if d.path == path]
    assert drifts, f"{line!r} in {path} was not reported"
    assert any(expected in d.expected or expected in d.found for d in drifts), [str(d) for d in drifts]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('raise RuntimeError("this path needs megatron-core 0.17; upgrade")\n', "megatron-core 0.18.0"),
        ('MESSAGE = f"torch_npu 2.9 cannot run {op}"\n', "torch-npu 2.10.0.post4"),
        ('"""Upstream: MindSpeed core_r0.17.0 transformer/dsa.py."""\n', "core_r0.18.0"),
        ('HINT = (\n    "verl "\n    "0.8.2 drops the layer"\n)\n', "verl 0.9.1"),
    ],
)
def test_a_stale_version_in_a_verl_npu_message_is_reported(tmp_path, source, expected):
    module = tmp_path / "verl_npu" / "engine" / "stale.py"
    module.parent.mkdir(parents=True)
    module.write_text("from __future__ import annotations\n\n" + source)
    drifts = find_drift(load_stack(), tmp_path)  # the default file set includes verl_npu's modules
    assert [d.path for d in drifts] == ["verl_npu/engine/stale.py"], [str(d) for d in drifts]
    assert expected in drifts[0].expected and drifts[0].line >= 3, str(drifts[0])


def test_pinned_versions_comments_and_quoted_requirements_in_verl_npu_are_not_drift(tmp_path):
    module = tmp_path / "verl_npu" / "ops" / "fine.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        '"""Upstream: megatron-core 0.18.0 transformer/dsa.py; MindSpeed core_r0.18.0; vLLM 0.23.0."""\n'
        "# CANN 8.0 took 16 ports (a comment about another release)\n"
        'A = "megatron-core 0.18 and torch_npu 2.10 and torch-npu 2.10.0.post4"\n'
        'A2 = "transformers 5.10\'s rope and CANN 9.1.0"\n'
        'B = "vllm-ascend 0.23 under vLLM 0.23"\n'
        'C = "vllm-ascend pins transformers==5.5.4 in its requirements"  # quoted, not ours\n'
        'D = "torch 2.10.0+cpu is torch 2.10.0; an unpinned-lib 1.2"\n'
    )
    assert find_drift(load_stack(), tmp_path) == []


def test_the_drift_lint_is_a_command_that_names_each_reference_and_fails(tmp_path):
    import subprocess
    import sys

    repo_copy = tmp_path / "repo"
    shutil.copytree(REPO / "docker", repo_copy / "docker")
    dockerfile = repo_copy / "docker" / "Dockerfile.a3"
    dockerfile.write_text(dockerfile.read_text().replace("SOC_VERSION=ascend910_9392", "SOC_VERSION=ascend910b4"))
    run = [sys.executable, "-m", "verl_npu.stack", "drift", "--repo"]
    done = subprocess.run([*run, str(repo_copy)], capture_output=True, text=True, check=False)
    assert done.returncode == 1, done.stderr
    assert "docker/Dockerfile.a3:" in done.stdout and "SOC_VERSION ascend910b4" in done.stdout
    clean = subprocess.run([*run, str(REPO)], capture_output=True, text=True, check=False)
    assert clean.returncode == 0, clean.stdout
