"""Environment rules: the variables verl reads (VERL_USE_EXTERNAL_MODULES, the NPU allocator, GLM-5.2's patch)."""

from __future__ import annotations

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.checks import Check as Finding
from verl_npu.doctor.probe import Probe
from verl_npu.stack import NPU_TARGETS

LAYER_MODULE = "verl_npu.megatron_adaptor"


def check_external_modules(probe: Probe, target: str) -> list[Finding]:
    value = probe.env.get("VERL_USE_EXTERNAL_MODULES", "")
    modules = [m.strip() for m in value.split(",") if m.strip()]
    fix = f"export VERL_USE_EXTERNAL_MODULES={LAYER_MODULE}  (set in the verl-npu images)"
    if LAYER_MODULE not in modules:
        status = FAIL if target in NPU_TARGETS else WARN
        shown = value if value else "unset"
        return [
            Finding(
                "verl.external-modules",
                status,
                f"VERL_USE_EXTERNAL_MODULES is {shown}: verl will not load the NPU layer",
                fix,
            )
        ]
    missing = [m for m in modules if not probe.module_locations(m)]
    if missing:
        return [
            Finding(
                "verl.external-modules",
                FAIL,
                f"VERL_USE_EXTERNAL_MODULES names modules that do not import: {', '.join(missing)} "
                "(`import verl` will fail)",
                "install them or remove them from VERL_USE_EXTERNAL_MODULES",
            )
        ]
    return [Finding("verl.external-modules", OK, value)]


def check_allocator_env(probe: Probe, target: str) -> list[Finding]:
    """PYTORCH_NPU_ALLOC_CONF with expandable segments stops vLLM's sleep mode (verl's default rollout)."""
    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS

    value = probe.env.get(ALLOC_CONF_VARIABLE)
    if value is None or EXPANDABLE_SEGMENTS not in value:
        shown = "unset" if value is None else f"={value}"
        return [Finding("env.npu-alloc-conf", OK, f"{ALLOC_CONF_VARIABLE} {shown}")]
    return [
        Finding(
            "env.npu-alloc-conf",
            FAIL if target in NPU_TARGETS else WARN,
            f"{ALLOC_CONF_VARIABLE}={value}: vllm-ascend's CaMemAllocator (vLLM sleep mode, verl's default "
            "rollout.enable_sleep_mode=True) asserts that it does not contain "
            f"{EXPANDABLE_SEGMENTS}, so the rollout cannot start",
            f"unset {ALLOC_CONF_VARIABLE} (the verl-npu images do not set it), or run the rollout with "
            "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        )
    ]


def check_glm52_rollout_patch(probe: Probe, target: str) -> list[Finding]:
    """verl 0.9.1's vllm-ascend 0.23 fixes for GLM-5.2 RL weight updates are opt-in (VERL_VLLM_ASCEND_GLM52_PATCH).

    Without them a GLM-5.2 rollout on Ascend disposes SFA's kv_b_proj after the first load (later weight
    syncs cannot rebuild the absorbed weights) and scores the indexer without its scale. Only a warning: other
    models do not need the patch, and verl applies it to every vLLM rollout once it is on.
    """
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE

    value = probe.env.get(GLM52_PATCH_VARIABLE)
    shown = "unset" if value is None else f"={value}"
    if target not in NPU_TARGETS:
        return [Finding("env.glm52-rollout-patch", OK, f"{GLM52_PATCH_VARIABLE} {shown} (vllm-ascend only)")]
    if value is not None and value.strip().lower() in GLM52_PATCH_ON_VALUES:  # verl's own test of the value
        return [Finding("env.glm52-rollout-patch", OK, f"{GLM52_PATCH_VARIABLE}={value}: verl's GLM-5.2 fixes are on")]
    return [
        Finding(
            "env.glm52-rollout-patch",
            WARN,
            f"{GLM52_PATCH_VARIABLE} {shown}: GLM-5.2 RL with vLLM rollouts on Ascend needs verl's vllm-ascend 0.23 "
            "fixes for weight updates (SFA keeps kv_b_proj, indexer weight scale, residual add, sleep and wake-up), "
            f"which verl applies only when it is {'/'.join(GLM52_PATCH_ON_VALUES)}",
            f"export {GLM52_PATCH_VARIABLE}=1 for GLM-5.2 (examples/glm5_2/glm5_2.env sets it; verl-npu forwards it "
            "to the Ray workers)",
        )
    ]
