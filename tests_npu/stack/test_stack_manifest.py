"""The manifest loader: the real manifest is valid, and every malformation is named precisely."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.stack import MANIFEST_PATH, UNVERIFIED, StackError, load_stack
from verl_npu.stack.plan import install_plan

UPSTREAM_FACTS = REPO / "docs" / "upstream_facts.md"


def test_real_manifest_loads_with_the_pinned_stack():
    stack = load_stack()
    assert stack.python == "3.12"
    assert stack.packages["verl"].version == "0.9.1"
    assert stack.git["megatron-lm"].version == "0.18.0"
    assert stack.expected_versions("a3")["megatron-core"] == "0.18.0"
    assert stack.expected_versions("dev")["megatron-core"] == "0.18.0"
    assert stack.chips["a2"].soc_version == "ascend910b1"
    assert stack.chips["a3"].soc_version == "ascend910_9392"
    assert stack.chips["a2"].hbm_gib == stack.chips["a3"].hbm_gib == 64
    for comp in stack.git.values():
        assert comp.commit == UNVERIFIED or re.fullmatch(r"[0-9a-f]{40}", comp.commit), comp.name


def test_every_pinned_commit_is_recorded_with_its_source_in_the_upstream_facts():
    """Never invent a commit: each verified commit must appear in docs/upstream_facts.md, with where it was read."""
    facts = UPSTREAM_FACTS.read_text()
    for comp in load_stack().git.values():
        if comp.verified:
            assert f"`{comp.commit}`" in facts, f"{comp.name} commit {comp.commit} is not in {UPSTREAM_FACTS.name}"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.toml"
    path.write_text(text)
    return path


def _mutate(tmp_path: Path, old: str, new: str) -> Path:
    text = MANIFEST_PATH.read_text()
    assert old in text, f"fixture out of date: {old!r} not in the manifest"
    return _write(tmp_path, text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "[git.vllm-ascend]\nurl",
            '[git.vllm-ascend]\ncomit = "x"\nurl',
            r"\[git\.vllm-ascend\] key 'comit' is not allowed.*did you mean 'commit'",
        ),
        (
            'commit = "4213c91313fe4de6da12794109515f6275572750"',
            'commit = "4213c91"',
            r"\[git\.mindspeed\] key 'commit' must be a full 40-character.*'4213c91'",
        ),
        (
            'commit = "ba7b5ebce12af60627a80985792a1449ce45f46c"',
            'commit = "BA7B5EBCE12AF60627A80985792A1449CE45F46C"',
            r"\[git\.megatron-lm\] key 'commit' must be a full 40-character lowercase hex",
        ),
        ('[packages.verl]\nversion = "0.9.1"\n', "[packages.verl]\n", r"\[packages\.verl\] key 'version' is missing"),
        (
            '[packages.verl]\nversion = "0.9.1"',
            '[packages.verl]\nversion = "0.9,1"',
            r"\[packages\.verl\] key 'version' is not a PEP 440 version: '0\.9,1'",
        ),
        (
            'soc_version = "ascend910b1"',
            'soc_version = "910b1"',
            r"\[chips\.a2\] key 'soc_version' is not an Ascend SOC_VERSION",
        ),
        (
            '[packages.torch-npu]\nversion = "2.10.0.post4"\ntargets = ["a2", "a3"]',
            '[packages.torch-npu]\nversion = "2.10.0.post4"\ntargets = ["a2", "a4"]',
            r"\[packages\.torch-npu\] key 'targets' names unknown target 'a4'",
        ),
        ('install = "vllm-ascend"', 'install = "make"', r"\[git\.vllm-ascend\] key 'install' must be one of"),
        (
            'url = "https://gitcode.com/Ascend/MindSpeed.git"',
            'url = "git@gitcode.com:Ascend/MindSpeed.git"',
            r"\[git\.mindspeed\] key 'url' must be an https:// URL",
        ),
        (
            "hbm_gib = 64  # Ascend 910B1",
            'hbm_gib = "64GB"  # Ascend 910B1',
            r"\[chips\.a2\] key 'hbm_gib' must be a positive integer \(GiB of device memory per NPU\), found '64GB'",
        ),
        ("schema = 1", "schema = 2", r"\[top level\] key 'schema' is 2; this verl-npu reads schema 1"),
        ('pairs_with = "torch"', 'pairs_with = "pytorch"', r"\[packages\.torch-npu\] key 'pairs_with' names 'pytorch'"),
        ("[python]", "[pyton]", r"\[top level\] key 'pyton' is not allowed.*did you mean 'python'"),
        (
            '"patches/vllm-ascend/0001-requirements-take-transformers-from-the-stack-drop-arctic-inference.patch"',
            '"../vllm-ascend.diff"',
            r"\[git\.vllm-ascend\] key 'patches' entry '\.\./vllm-ascend\.diff' must be a path under patches/",
        ),
        ('replaces = ["triton"]', 'replaces = "triton"', r"\[packages\.triton-ascend\] key 'replaces' must be a list"),
        (
            'replaces = ["triton"]',
            'replaces = ["torch"]',
            r"\[packages\.triton-ascend\] key 'replaces' names 'torch', which the manifest itself installs",
        ),
        (
            'replaces = ["triton"]',
            'replaces = ["triton-ascend"]',
            r"\[packages\.triton-ascend\] key 'replaces' names the package itself",
        ),
        ("\nbuild_isolation = false", '\nbuild_isolation = "no"', r"\[git\.vllm\] key 'build_isolation' must be true"),
        (
            "\nbuild_isolation = false",
            "\nbuild_isolation = true",
            r"\[git\.vllm\] key 'build_requires_skip' applies only to a build without isolation",
        ),
        (
            'build_requires_skip = ["torch", "cmake", "ninja"]',
            'build_requires_skip = ["torch", "torch"]',
            r"\[git\.vllm\] key 'build_requires_skip' lists a distribution twice",
        ),
        (
            'build_requires_skip = ["torch", "cmake", "ninja"]',
            'build_requires_skip = ["torch,cmake"]',
            r"\[git\.vllm\] key 'build_requires_skip' must be a list of distribution names",
        ),
    ],
)
def test_malformed_manifest_errors_name_file_table_and_key(tmp_path, old, new, expected):
    path = _mutate(tmp_path, old, new)
    with pytest.raises(StackError, match=expected) as info:
        load_stack(path)
    assert str(path) in str(info.value)


def test_invalid_toml_and_missing_file_are_named(tmp_path):
    with pytest.raises(StackError, match=r"stack\.toml: not valid TOML"):
        load_stack(_write(tmp_path, "schema = [\n"))
    with pytest.raises(StackError, match=r"nope\.toml: manifest not found"):
        load_stack(tmp_path / "nope.toml")


def test_plan_orders_the_ascend_adaptation_and_keeps_torch_first():
    stack = load_stack()
    for target in ("a2", "a3"):
        names = [step.name for step in install_plan(stack, target)]
        assert names[:2] == ["python3.12", target]
        assert names.index("torch") < names.index("torch-npu") < names.index("megatron-lm")
        assert names.index("megatron-lm") < names.index("megatron-adaptor")
        assert names.index("megatron-adaptor") < names.index("transformer-engine-npu") < names.index("mindspeed")
        assert names[-3:] == ["verl-npu", "upstream-contracts", "build-manifest.json"]
    dev = [step.name for step in install_plan(stack, "dev", dev_tools=True)]
    assert "torch-npu" not in dev and "mindspeed" not in dev and "megatron-core" in dev
    with pytest.raises(StackError, match="unknown target 'a5'; valid targets: a2, a3, dev"):
        install_plan(stack, "a5")


@pytest.mark.parametrize("target", ["a2", "a3"])
def test_plan_installs_torch_companions_first_patches_vllm_ascend_and_replaces_triton_last(target):
    steps = install_plan(load_stack(), target)
    kinds = [(step.kind, step.name) for step in steps]
    # vllm-ascend pins torchvision and torchaudio: the CPU builds go in right after torch, from its index.
    torch = kinds.index(("pip", "torch"))
    assert kinds[torch : torch + 3] == [("pip", "torch"), ("pip", "torchvision"), ("pip", "torchaudio")]
    for step in steps[torch : torch + 3]:
        assert step.fields["index_x86_64"] == "https://download.pytorch.org/whl/cpu"
    vllm_ascend = steps[kinds.index(("git", "vllm-ascend"))]
    assert vllm_ascend.fields["patches"] == (
        "patches/vllm-ascend/0001-requirements-take-transformers-from-the-stack-drop-arctic-inference.patch"
    )
    # After every other third-party install: upstream triton out, triton-ascend back over it.
    replace = kinds.index(("replace", "triton-ascend"))
    assert steps[replace].fields == {
        "requirement": "triton-ascend==3.2.2",
        "index": "https://triton-ascend.osinfra.cn/pypi/simple/",
        "remove": "triton",
    }
    assert max(i for i, (kind, _) in enumerate(kinds) if kind in ("pip", "git")) < replace
    assert kinds[replace + 1 :] == [
        ("local", "verl-npu"),
        ("contracts", "upstream-contracts"),
        ("build-manifest", "build-manifest.json"),
    ]
    assert "replace" not in {step.kind for step in install_plan(load_stack(), "dev")}


def test_plan_refuses_a_git_patch_file_that_does_not_exist(tmp_path):
    path = _mutate(
        tmp_path,
        '"patches/vllm-ascend/0001-requirements-take-transformers-from-the-stack-drop-arctic-inference.patch"',
        '"patches/vllm-ascend/0009-missing.patch"',
    )
    with pytest.raises(
        StackError, match=r"\[git\.vllm-ascend\] key 'patches' names 'patches/vllm-ascend/0009-missing\.patch'"
    ):
        install_plan(load_stack(path), "a3")
    install_plan(load_stack(path), "dev")  # dev has no vllm-ascend


def test_plan_refuses_a_patch_file_that_does_not_exist(tmp_path):
    path = _mutate(
        tmp_path,
        '"patches/mbridge/0002-build-models-with-megatron-core-0.18-model-types.patch"',
        '"patches/mbridge/0009-missing.patch"',
    )
    with pytest.raises(
        StackError, match=r"\[packages\.mbridge\] key 'patches' names 'patches/mbridge/0009-missing\.patch'"
    ):
        install_plan(load_stack(path), "dev")


def test_constraints_pin_every_distribution_of_the_target():
    stack = load_stack()
    assert set(stack.constraints("a3")) == {f"{n}=={v}" for n, v in stack.expected_versions("a3").items()}
    assert "torch-npu==2.10.0.post4" in stack.constraints("a3")
    assert "megatron-core==0.18.0" in stack.constraints("a3")
    assert "vllm==0.23.0" in stack.constraints("a3")
    assert {"torchvision==0.25.0", "torchaudio==2.10.0"} <= set(stack.constraints("a3"))
    assert not any(c.startswith("torch-npu") for c in stack.constraints("dev"))


def test_a_manifest_that_is_a_fifo_is_refused_at_once(tmp_path):
    import os

    from verl_npu.stack.manifest import StackError, load_stack

    fifo = tmp_path / "stack.toml"
    os.mkfifo(fifo)  # reading it would block until someone writes
    with pytest.raises(StackError, match="not a regular file"):
        load_stack(fifo)
