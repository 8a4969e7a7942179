"""The environment rules: VERL_USE_EXTERNAL_MODULES, the NPU allocator, verl's GLM-5.2 rollout patch."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.doctor_env import (
    DEV_MODULES,
    LAYER,
    NPU_MODULES,
    NPU_SMI_A3,
    make_probe,
    make_tree,
    only,
)

from verl_npu import doctor
from verl_npu.doctor import FAIL, OK, WARN


def test_external_modules_unset_on_dev_warns(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)])
    finding = only(doctor.check_external_modules(probe, "dev"), "verl.external-modules")
    assert finding.status == WARN
    assert "VERL_USE_EXTERNAL_MODULES is unset" in finding.detail
    assert finding.fix.startswith(f"export VERL_USE_EXTERNAL_MODULES={LAYER}")


def test_external_modules_unset_on_a3_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, NPU_MODULES)], npu=NPU_SMI_A3)
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL
    assert f"VERL_USE_EXTERNAL_MODULES={LAYER}" in finding.fix


def test_external_modules_without_the_layer_fails_on_a3(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, NPU_MODULES)], env={"VERL_USE_EXTERNAL_MODULES": "mindspeed"})
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL and "VERL_USE_EXTERNAL_MODULES is mindspeed" in finding.detail


def test_external_modules_layer_not_importable_fails(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, ["megatron/core"])], env={"VERL_USE_EXTERNAL_MODULES": LAYER})
    finding = only(doctor.check_external_modules(probe, "dev"), "verl.external-modules")
    assert finding.status == FAIL
    assert f"do not import: {LAYER}" in finding.detail


def test_external_modules_extra_module_not_importable_fails(tmp_path: Path) -> None:
    env = {"VERL_USE_EXTERNAL_MODULES": f"{LAYER}, no_such_module"}
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)], env=env)
    finding = only(doctor.check_external_modules(probe, "a3"), "verl.external-modules")
    assert finding.status == FAIL
    assert "do not import: no_such_module" in finding.detail and LAYER not in finding.detail.split(":")[1]


def test_external_modules_set_ok(tmp_path: Path) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {}, DEV_MODULES)], env={"VERL_USE_EXTERNAL_MODULES": LAYER})
    for target in ("dev", "a3"):
        finding = only(doctor.check_external_modules(probe, target), "verl.external-modules")
        assert (finding.status, finding.detail) == (OK, LAYER)


@pytest.mark.parametrize(("target", "status"), [("a3", FAIL), ("dev", WARN)])
def test_expandable_segments_are_flagged_for_vllm_sleep_mode(tmp_path: Path, target, status) -> None:
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    (finding,) = doctor.check_allocator_env(probe, target)
    assert finding.status == status and "CaMemAllocator" in finding.detail and "enable_sleep_mode=False" in finding.fix
    plain = make_probe([make_tree(tmp_path / "sp2", {})], env={"PYTORCH_NPU_ALLOC_CONF": "page_size:1g"})
    assert doctor.check_allocator_env(plain, target)[0].status == OK


@pytest.mark.parametrize("value", [None, "0", "false", "on", ""])
def test_an_ascend_node_without_verls_glm52_rollout_fixes_is_warned(tmp_path: Path, value) -> None:
    env = {} if value is None else {"VERL_VLLM_ASCEND_GLM52_PATCH": value}
    probe = make_probe([make_tree(tmp_path / "sp", {})], env=env)
    (finding,) = doctor.check_glm52_rollout_patch(probe, "a3")
    assert (finding.check, finding.status) == ("env.glm52-rollout-patch", WARN)
    assert "GLM-5.2 RL with vLLM rollouts on Ascend" in finding.detail and "1/true/yes" in finding.detail
    assert "examples/glm5_2/glm5_2.env sets it" in finding.fix and "VERL_VLLM_ASCEND_GLM52_PATCH=1" in finding.fix
    (dev,) = doctor.check_glm52_rollout_patch(probe, "dev")  # no vllm-ascend on a dev box
    assert dev.status == OK


@pytest.mark.parametrize("value", ["1", "true", "YES", " yes "])
def test_an_ascend_node_with_verls_glm52_rollout_fixes_is_ok(tmp_path: Path, value) -> None:
    """The values verl's patch accepts (stripped, lowercased: verl/utils/vllm/npu_vllm_patch.py)."""
    probe = make_probe([make_tree(tmp_path / "sp", {})], env={"VERL_VLLM_ASCEND_GLM52_PATCH": value})
    for target in ("a2", "a3"):
        (finding,) = doctor.check_glm52_rollout_patch(probe, target)
        assert finding.status == OK and "fixes are on" in finding.detail
