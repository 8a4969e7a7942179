"""``verl-npu preflight``: is a launch valid for verl 0.9.1 + verl_npu, and does it fit?

A 32-node job waits hours in a queue and then dies in minutes on a typo, a mesh that does not
divide or an out-of-memory. Preflight answers before it queues, on any machine (no NPU):

1. ``launch``: the bash launch script is read statically (never run) and the trainer's overrides
   recovered, with script bugs it can see;
2. ``config_check``: the overrides composed with verl's own Hydra config, then verl's validation
   and the engine's build plan;
3. ``mesh``: the device mesh of every role;
4. ``memory``: HBM per device per pipeline stage and host RAM per node.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu.preflight.checks import FAIL, OK, WARN, Check, verdict

GLM5_NAME = re.compile(r"glm-?5", re.IGNORECASE)
GLM5_2_NAME = re.compile(r"glm-?5(?:[._-]?2)(?!\d)", re.IGNORECASE)  # GLM-5.2, glm5_2, GLM-5-2, glm52


@dataclasses.dataclass
class PreflightReport:
    source: str
    chip: str
    checks: list[Check]
    overrides: list[str]
    model: dict[str, Any] | None = None
    memory: Any = None  # verl_npu.preflight.memory.MemoryEstimate
    model_origin: str | None = None  # FROM_MODEL_CONFIG, FROM_MODEL_PATH, FROM_BESIDE_SCRIPT or FROM_NAME

    @property
    def verdict(self) -> str:
        return verdict(self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "chip": self.chip,
            "verdict": self.verdict,
            "checks": [c.to_dict() for c in self.checks],
            "overrides": self.overrides,
            "model": self.model,
            "model_origin": self.model_origin,
            "memory": self.memory.to_dict() if self.memory is not None else None,
        }


def _launch_checks(launch: Any) -> list[Check]:
    checks = []
    for finding in launch.findings:  # the reader's messages name their line
        status = FAIL if finding.severity == "error" else WARN
        checks.append(Check("launch", finding.code, status, finding.message))
    if launch.module is not None:
        where = f"line {launch.trainer_line}" if launch.trainer_line else launch.source
        checks.append(
            Check("launch", "trainer", OK, f"{launch.module} with {len(launch.overrides)} overrides ({where})")
        )
    return checks


# where the model config came from (PreflightReport.model_origin)
FROM_MODEL_CONFIG, FROM_MODEL_PATH, FROM_BESIDE_SCRIPT, FROM_NAME = (
    "model-config",
    "model-path",
    "beside-script",
    "name",
)
Resolved = tuple[dict[str, Any] | None, Check, str | None]  # (HF config dict, the "model" check, origin)


def resolve_model(model_path: str | None, model_config: str | None, beside_script: str | None = None) -> Resolved:
    """The HF config (as a dict), the check saying where it came from, and that origin.

    In order: --model-config; the launch's model path when it is on this machine; a ``config.json`` beside the
    launch script (``beside_script``: an example ships its model's published architecture there, e.g.
    examples/glm5_2/config.json); for a GLM-5 / GLM-5.2 path (the usual case on a laptop) transformers'
    ``GlmMoeDsaConfig`` defaults, with GLM-5.2's published differences for a GLM-5.2 name, with a warning. Any
    other missing model is an error.
    """
    from verl_npu.preflight.memory_plan import load_hf_config

    def failed(message: str) -> Resolved:
        return None, Check("config", "model", FAIL, message), None

    source = model_config or model_path
    if source is None:
        return failed("no model: set actor_rollout_ref.model.path or --model-config")
    try:
        origin = FROM_MODEL_CONFIG if model_config else FROM_MODEL_PATH
        return load_hf_config(source), Check("config", "model", OK, f"model config from {source}"), origin
    except (ValueError, OSError) as exc:
        missing = exc
    if model_config is None and beside_script is not None:
        try:
            hf = load_hf_config(beside_script)
        except (ValueError, OSError) as exc:
            return failed(f"{model_path}: {missing}; and {beside_script}: {exc}")
        message = (
            f"model config from {beside_script} (beside the launch script): {model_path} is not on this machine; "
            "pass --model-config PATH to check another config.json"
        )
        return hf, Check("config", "model", OK, message), FROM_BESIDE_SCRIPT
    name = Path(model_path).name if model_path else ""
    if model_config is None and GLM5_NAME.search(name):
        glm52 = bool(GLM5_2_NAME.search(name))
        what = (
            "GLM-5.2's published architecture (transformers' GlmMoeDsaConfig defaults with GLM-5.2's indexer_types: "
            "21 full / 57 shared DSA layers, RoPE theta 8e6, fp32 router)"
            if glm52
            else "GLM-5's shape from transformers' GlmMoeDsaConfig (every DSA layer full)"
        )
        message = f"{model_path} is not on this machine; using {what} (pass --model-config PATH to check the real "
        message += "config.json)"
        return load_hf_config("glm5.2" if glm52 else "glm5"), Check("config", "model", WARN, message), FROM_NAME
    return failed(f"{missing}; pass --model-config with a config.json, a model directory, 'glm5' or 'glm5.2'")


def run_preflight(
    script: str | Path | None,
    extra: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    chip: str = "a3",
    model_config: str | None = None,
    platform: str = "ascend",
    host_memory_gib: float | None = None,
    use_cache: bool = True,
) -> PreflightReport:
    """Every check on one launch: a script (``extra`` are its "$@") or, without a script, overrides."""
    from omegaconf.errors import OmegaConfBaseException

    from verl_npu.preflight import config_check
    from verl_npu.preflight import launch as launch_reader
    from verl_npu.preflight.worker import PreflightWorker

    if script is not None:
        launch = launch_reader.read_launch_script(script, list(extra), dict(env or {}))
        source = str(script)
    else:
        launch = launch_reader.launch_from_overrides(list(extra))
        source = "<overrides>"
    report = PreflightReport(source, chip, _launch_checks(launch), list(launch.overrides))
    if launch.module is None:
        return report
    beside = Path(script).parent / "config.json" if script is not None else None
    beside_script = str(beside) if beside is not None and beside.is_file() else None
    # torch, transformers and verl load meanwhile, in a child process (unless the answer is cached)
    worker = PreflightWorker(launch.config_name, list(launch.overrides), model_config, use_cache, beside_script)
    try:
        config, checks = config_check.compose_config(launch.config_name, launch.overrides)
        report.checks += checks
        if config is None:
            return report
        position = len(report.checks)  # verl's own validation is reported right after composition
        try:
            resolved = config_check.as_mapping(config)
        except OmegaConfBaseException as exc:
            report.checks.append(Check("config", "interpolation", FAIL, f"a value does not resolve: {exc}"))
            return report
        launch_env = {**dict(env or {}), **launch.env}
        report.checks += config_check.rollout_environment_checks(resolved, launch_env)
        model_path = resolved["actor_rollout_ref"]["model"].get("path")
        hf, model_check, verl_checks, report.model_origin = worker.ask(config, model_path, model_config)
        report.checks[position:position] = verl_checks
        report.checks.append(model_check)
        if hf is not None:
            stand_in = report.model_origin in (FROM_BESIDE_SCRIPT, FROM_NAME)
            report.checks += config_check.rollout_model_checks(resolved, hf, launch_env, platform, model_path, stand_in)
            _engine_mesh_memory(report, resolved, hf, platform, chip, host_memory_gib)
        return report
    finally:
        worker.cancel()


def _engine_mesh_memory(
    report: PreflightReport,
    resolved: Mapping[str, Any],
    hf: Mapping[str, Any],
    platform: str,
    chip: str,
    host_memory_gib: float | None,
) -> None:
    from verl_npu.preflight import config_check, memory_plan, mesh

    report.checks += config_check.engine_plans(resolved, hf, platform)
    shape = memory_plan.model_shape(hf)
    report.model = memory_plan.describe_model(shape)
    mesh_checks, actor_mesh = mesh.check_mesh(resolved, shape.num_layers, shape.num_experts)
    report.checks += mesh_checks
    if any(c.status == FAIL for c in mesh_checks):
        return
    report.memory, memory_checks = memory_plan.estimate_launch(
        resolved, shape, actor_mesh, chip=chip, host_memory_gib=host_memory_gib, platform=platform
    )
    report.checks += memory_checks
