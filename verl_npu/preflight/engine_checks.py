"""What verl-npu's engine and rollout make of a composed launch config, in preflight's parent process (no torch).

The engine's build plan (``verl_npu.engine.build_plan``, the code the engine itself runs at build time) judges each
Megatron role's verl-npu features; the model's family (verl_npu.models) says whether its bridge can build the model
and which DSA layers each pipeline stage holds; the rollout checks say what vLLM on Ascend cannot serve.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.preflight.values import MEGATRON, ROLE_SECTIONS, LaunchValues


def _megatron_roles(config: Mapping[str, Any], values: LaunchValues) -> dict[str, tuple[Mapping[str, Any], Any]]:
    """Each Megatron role's (engine config, optimizer config): the actor, the reference model, an enabled critic.

    Which roles are Megatron engines is the typed view's answer (an FSDP actor has none); their sections are there
    and are mappings (the view checked).
    """
    roles = {}
    for role in values.megatron_roles:
        section = config
        for key in ROLE_SECTIONS[role].split("."):
            section = section[key]
        optim = {} if role == "ref" else section.get("optim") or {}  # the reference model has no optimizer
        roles[role] = (section[MEGATRON], optim)
    return roles


def engine_plans(
    config: Mapping[str, Any], values: LaunchValues, hf_config: Any, platform: str
) -> tuple[dict[str, Any], list[Check]]:
    """The engine's build plan for each Megatron role (resolved config), the call the engine makes at build time.

    ``values``: the config's typed view; every value the plans compute with is in range. Returns the roles'
    BuildPlans (those that build) and the checks: every violated rule of every role at once.
    """
    from verl_npu.engine.build_plan import BuildPlanError, build_plan

    roles = _megatron_roles(config, values)
    plans, checks = {}, []
    for role, (engine, optim) in roles.items():
        try:
            plan = plans[role] = build_plan(engine, optim, hf_config, platform)
        except BuildPlanError as exc:
            checks += [Check(f"engine.{role}-build-plan", FAIL, f"{role}: {problem}") for problem in exc.problems]
            continue
        features = ", ".join(plan.features) or "no verl-npu features"
        checks.append(Check(f"engine.{role}-build-plan", OK, f"{role} on {platform}: {features}"))
        checks += [Check(f"engine.{role}-build-plan", OK, f"{role}: {note}") for note in plan.notes]
        checks += [Check(f"engine.{role}-build-plan", WARN, f"{role}: {note}") for note in plan.warnings]
    layouts: dict[str, Any] = {}  # each distinct pipeline layout once (the ref usually mirrors the actor)
    for role, (engine, _) in roles.items():
        key = _layout_key(engine)
        if all(_layout_key(other) != key for other in layouts.values()):
            layouts[role] = engine
    checks += model_bridge_checks(hf_config, layouts)
    return plans, checks


def _layout_key(engine: Mapping[str, Any]) -> tuple:
    from verl_npu.engine.build_plan import pipeline_layout

    otc = engine.get("override_transformer_config") or {}
    return pipeline_layout(engine), otc.get("num_layers_per_virtual_pipeline_stage")


def model_bridge_checks(hf_config: Mapping[str, Any], layouts: Mapping[str, Any] | None = None) -> list[Check]:
    """Whether the engine's bridge can build this model (a registered DSA family's mapping, verl_npu.models; others:
    mbridge's own), and for IndexShare layers which layers of each pipeline stage (of each role's layout) are full
    and shared."""
    from verl_npu.models import family as model_family

    family = model_family.family_of(hf_config.get("model_type"))
    if family is None:
        return []
    try:
        family.megatron_fields(model_family.as_attributes(hf_config))
    except (NotImplementedError, ValueError) as exc:
        return [Check("engine.model-bridge", FAIL, f"the model cannot be built: {exc}")]
    kinds = family.indexer_kinds(model_family.as_attributes(hf_config))
    message = f"{family.model_type}: verl-npu's {family.name} bridge maps this config"
    if model_family.SHARED not in kinds:
        return [Check("engine.model-bridge", OK, f"{message}; every layer's DSA indexer is full")]
    full = [i for i, kind in enumerate(kinds) if kind != model_family.SHARED]
    message += (
        f"; IndexShare: {len(full)} full / {len(kinds) - len(full)} shared DSA layers (a shared layer reuses the most "
        f"recent full layer's top-k and has no indexer), full {_numbers(full)}"
    )
    checks = [Check("engine.model-bridge", OK, message)]
    layouts = layouts or {}
    for role, engine in layouts.items():
        prefix = f"{role} " if len(layouts) > 1 else ""
        checks += [Check("engine.model-bridge", OK, prefix + line) for line in stage_layout_lines(kinds, engine)]
    return checks


def _numbers(layers: Sequence[int]) -> str:
    return ", ".join(map(str, layers)) if layers else "none"


def stage_layout_lines(kinds: Sequence[str], engine: Mapping[str, Any]) -> list[str]:
    """Per pipeline stage (model chunk): its layers, which are full, and whether it starts on a carried top-k.

    E.g. "stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0)". Empty when the layers do not
    split over the layout (the mesh check says why).
    """
    from verl_npu.engine.build_plan import model_chunks, pipeline_layout
    from verl_npu.engine.index_share import stage_plans

    try:
        chunks = model_chunks(len(kinds), pipeline_layout(engine, len(kinds)))
    except ValueError:
        return []
    plans = stage_plans(kinds, [c.num_layers for c in chunks])
    lines = []
    for i, (chunk, plan) in enumerate(zip(chunks, plans, strict=True)):
        layers = range(chunk.first_layer, chunk.first_layer + chunk.num_layers)
        full = [n for n in layers if kinds[n] != "shared"]
        line = f"{chunk.name}: {chunk.layers}, " + (
            "all full" if len(full) == len(layers) else f"full {_numbers(full)}"
        )
        if plan.receives:
            line += f"; starts shared (carry from {chunks[i - 1].name})"
        lines.append(line)
    return lines


def rollout_environment_checks(config: Mapping[str, Any], env: Mapping[str, str]) -> list[Check]:
    """Environment the rollout cannot start with: expandable segments under vLLM's sleep mode."""
    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS

    rollout = _section(config, "actor_rollout_ref", "rollout")
    value = env.get(ALLOC_CONF_VARIABLE)
    if rollout.get("name") != "vllm" or value is None or EXPANDABLE_SEGMENTS not in value:
        return []
    if not rollout.get("enable_sleep_mode", True):
        return [
            Check(
                "launch.npu-alloc-conf",
                OK,
                f"{ALLOC_CONF_VARIABLE}={value} with vLLM sleep mode off (rollout.enable_sleep_mode=False)",
            )
        ]
    return [
        Check(
            "launch.npu-alloc-conf",
            FAIL,
            f"{ALLOC_CONF_VARIABLE}={value} with vLLM sleep mode (actor_rollout_ref.rollout.enable_sleep_mode=True, "
            f"verl's default): vllm-ascend's CaMemAllocator asserts that it does not contain {EXPANDABLE_SEGMENTS}, "
            f"so the rollout cannot start. Instead: leave {ALLOC_CONF_VARIABLE} unset (the verl-npu images do not "
            "set it), or add +actor_rollout_ref.rollout.enable_sleep_mode=False (a RolloutConfig field verl's "
            "YAML does not list)",
        )
    ]


# a model directory named for its FP8 release (GLM-5.2-FP8, DeepSeek-V3-fp8, ...)
_FP8_NAME = re.compile(r"(?:^|[-_.])fp8(?:$|[-_.])", re.IGNORECASE)


def rollout_model_checks(
    config: Mapping[str, Any],
    hf_config: Mapping[str, Any],
    env: Mapping[str, str],
    platform: str = "ascend",
    model_path: str | None = None,
    model_config_is_stand_in: bool = False,
) -> list[Check]:
    """What the rollout cannot serve for this model: GLM-5 / GLM-5.2 (glm_moe_dsa) with vLLM on Ascend without
    verl's GLM-5.2 patch, an FP8 checkpoint with vLLM on Ascend, and MTP speculative decoding on a glm_moe_dsa model.

    ``env`` is the trainer's environment (the launch's exports and --env); ``model_config_is_stand_in``: the config
    came from somewhere else than the model path (beside the script, or a name fallback), so the path's name is
    evidence too.
    """
    from verl_npu.contracts.vllm_ascend import GLM52_PATCH_ON_VALUES, GLM52_PATCH_VARIABLE
    from verl_npu.models.glm5.config import MODEL_TYPE

    rollout = _section(config, "actor_rollout_ref", "rollout")
    name = rollout.get("name")
    vllm_on_ascend = name == "vllm" and platform == "ascend"
    glm = hf_config.get("model_type") == MODEL_TYPE
    checks = []
    if glm and vllm_on_ascend:
        value = env.get(GLM52_PATCH_VARIABLE)
        shown = " is not set" if value is None else f"={value!r}"
        if value is not None and value.strip().lower() in GLM52_PATCH_ON_VALUES:  # verl's own test of the value
            checks.append(
                Check(
                    "launch.glm52-patch",
                    OK,
                    f"{GLM52_PATCH_VARIABLE}={value}: verl's vllm-ascend 0.23 GLM-5.2 fixes are on",
                )
            )
        else:
            checks.append(
                Check(
                    "launch.glm52-patch",
                    FAIL,
                    f"{GLM52_PATCH_VARIABLE}{shown} in the launch's environment: verl 0.9.1 ships vllm-ascend 0.23's "
                    "fixes for GLM-5.2 RL weight updates (SFA keeps kv_b_proj for later weight syncs instead of "
                    "disposing it, the SFA indexer weight scale, the explicit residual add before RMSNorm, an NPU "
                    "synchronize before sleep, wake-up and dummy-batch fixes) only behind it: without them SFA "
                    "disposes kv_b_proj after the first load, so later weight syncs cannot rebuild its absorbed "
                    "weights and the rollout no longer samples from the policy. Instead: set "
                    f"{GLM52_PATCH_VARIABLE}=1 in the launch's env file (verl-npu forwards the variables named there "
                    f"to the Ray workers; verl accepts {'/'.join(GLM52_PATCH_ON_VALUES)})",
                )
            )
    quant = hf_config.get("quantization_config") or {}
    method = str(quant.get("quant_method") or "").lower() if isinstance(quant, Mapping) else ""
    named_fp8 = model_config_is_stand_in and bool(model_path and _FP8_NAME.search(Path(model_path).name))
    if vllm_on_ascend and (method == "fp8" or named_fp8):
        why = (
            "its config.json has quantization_config.quant_method=fp8"
            if method == "fp8"
            else f"its name says FP8 (the config preflight used is a stand-in: {model_path} is not on this machine)"
        )
        checks.append(
            Check(
                "config.rollout-fp8",
                FAIL,
                f"actor_rollout_ref.model.path={model_path} is an FP8 checkpoint: {why}. The rollout is vLLM on "
                "Ascend, and vllm-ascend 0.23's fp8 path is MXFP8 for the Ascend 950 only while its SFA attention "
                "asserts an unquantised kv_b_proj, so the rollout cannot load it on A2/A3. Instead: point "
                "actor_rollout_ref.model.path at the BF16 checkpoint (the actor trains in BF16 either way)",
            )
        )
    mtp = _section(rollout, "mtp")  # what verl's rollout reads (by default an interpolation of model.mtp)
    speculative = _section(rollout, "engine_kwargs", "vllm").get("speculative_config")
    if not (isinstance(speculative, Mapping) and "mtp" in str(speculative.get("method") or "")):
        speculative = None  # a separate draft model or n-gram drafting needs no weights from the actor
    mtp_on = bool(mtp.get("enable") and mtp.get("enable_rollout"))
    if glm and (mtp_on or speculative):
        what = (
            "actor_rollout_ref.model.mtp.enable=True with enable_rollout=True (verl's MtpConfig: the rollout "
            f"drafts with the model's MTP layer, method {mtp.get('method')!r})"
            if mtp_on
            else f"actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config={speculative!r}"
        )
        load_format = str(rollout.get("load_format") or "dummy")
        dummy = load_format.startswith("dummy")
        checks.append(
            Check(
                "config.rollout-mtp",
                FAIL if dummy else WARN,
                f"{what}: speculative decoding on {MODEL_TYPE}, but verl-npu's GLM-5 bridge builds no MTP layers, so "
                "verl's weight sync sends none"
                + (
                    f" and under load_format={load_format!r} (verl's default) the draft head stays random: every "
                    "draft is rejected"
                    if dummy
                    else f"; under load_format={load_format!r} the draft head is the checkpoint's and never follows "
                    "the policy, so acceptance falls as training moves"
                )
                + ". Instead: turn rollout MTP off (actor_rollout_ref.model.mtp.enable_rollout=False and no "
                "speculative_config)",
            )
        )
    return checks


def _section(config: Any, *keys: str) -> Mapping[str, Any]:
    """The mapping at ``keys`` ({} where a section is absent, e.g. deleted with ``~``, or not a mapping)."""
    for key in keys:
        config = config.get(key) if isinstance(config, Mapping) else None
    return config if isinstance(config, Mapping) else {}
