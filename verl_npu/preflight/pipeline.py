"""``verl-npu preflight``, top to bottom: read the launch, compose, validate, build plans, mesh, memory, report.

:func:`run_preflight` is the whole pipeline; each step below it is one function, in the order they run. The
target (the chip: its HBM, and the platform its engine builds for) is decided once, here, and flows into both
the build plans and the memory estimate; the model's shape is read once (:class:`ModelShape`) and handed down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_npu.checks import FAIL, OK, WARN, Check, failed
from verl_npu.preflight.model import FROM_BESIDE_SCRIPT, FROM_NAME
from verl_npu.preflight.report import PreflightReport

if TYPE_CHECKING:
    from verl_npu.engine.build_plan import BuildPlan
    from verl_npu.preflight.launch import Launch
    from verl_npu.preflight.mesh import TrainMesh
    from verl_npu.preflight.model_shape import ModelShape
    from verl_npu.preflight.worker import PreflightWorker

ASCEND = "ascend"  # every chip of the stack manifest (a2, a3) is an Ascend NPU


@dataclasses.dataclass(frozen=True)
class Target:
    """What the launch runs on: the chip, its HBM per device, and the platform the engine builds for."""

    chip: str
    platform: str
    hbm_bytes: int


def target(chip: str, platform: str | None = None) -> Target:
    """The chip's target from the stack manifest; ``platform`` overrides the chip's (``ascend``) to check the same
    launch as another platform's engine would build it."""
    from verl_npu.engine.build_plan import PLATFORMS
    from verl_npu.preflight.memory import GiB
    from verl_npu.stack.manifest import load_stack

    chips = load_stack().chips
    if chip not in chips:
        raise ValueError(f"chip {chip!r}: the stack manifest knows {', '.join(sorted(chips))}")
    platform = platform or ASCEND
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    return Target(chip, platform, chips[chip].hbm_gib * GiB)


@dataclasses.dataclass(frozen=True)
class _Request:
    """One preflight's inputs besides the launch."""

    target: Target
    model_config: str | None
    env: Mapping[str, str]
    host_memory_gib: float | None


def run_preflight(
    script: str | Path | None,
    extra: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    chip: str = "a3",
    model_config: str | None = None,
    platform: str | None = None,
    host_memory_gib: float | None = None,
    use_cache: bool = True,
) -> PreflightReport:
    """Every check on one launch: a script (``extra`` are its "$@") or, without a script, overrides."""
    launch, source = read_launch(script, extra, dict(env or {}))
    report = PreflightReport(source, chip, launch_checks(launch), list(launch.overrides))
    if launch.module is None:
        target(chip, platform)  # an unknown chip or platform is an error whatever the launch
        return report
    worker = start_worker(script, launch, model_config, use_cache)  # first: its imports are the critical path
    try:
        request = _Request(target(chip, platform), model_config, dict(env or {}), host_memory_gib)
        _check(report, launch, worker, request)
    finally:
        worker.cancel()
    return report


def _check(report: PreflightReport, launch: Launch, worker: PreflightWorker, request: _Request) -> None:
    """Compose, validate, build plans, mesh, memory: each step adds its checks; a step that fails ends it."""
    from verl_npu.preflight import config_check
    from verl_npu.preflight.model_shape import ModelShape

    before = len(report.checks)
    config = compose(report, launch, worker)
    if config is None:
        return
    position = len(report.checks)  # verl's own validation is reported right after composition
    compose_checks = report.checks[before:position]
    resolved = resolve(report, config)
    if resolved is None:
        return
    launch_env = {**request.env, **launch.env}
    report.checks += config_check.rollout_environment_checks(resolved, launch_env)
    if worker.running:
        _prefetch()
    hf = validate(report, worker, config, compose_checks, resolved, request.model_config, position)
    if hf is None:
        return
    stand_in = report.model_origin in (FROM_BESIDE_SCRIPT, FROM_NAME)  # the model path's name is evidence too
    model_path = resolved["actor_rollout_ref"]["model"].get("path")
    platform = request.target.platform
    report.checks += config_check.rollout_model_checks(resolved, hf, launch_env, platform, model_path, stand_in)
    plans = build_plans(report, resolved, hf, request.target)
    shape = ModelShape.from_dict(hf)
    report.model = shape.describe()
    actor_mesh = mesh(report, resolved, shape)
    if actor_mesh is not None and "actor" in plans:
        memory(report, resolved, shape, actor_mesh, plans["actor"], request)


def _prefetch() -> None:
    """Import what the steps after verl's validation need while the worker imports verl (the parent waits anyway)."""
    import rich.console
    import rich.table  # noqa: F401

    import verl_npu.engine.build_plan
    import verl_npu.preflight.memory_plan  # noqa: F401


# --- the steps, in order ---------------------------------------------------------------------------------------
def read_launch(script: str | Path | None, extra: Sequence[str], env: Mapping[str, str]) -> tuple[Launch, str]:
    """The launch (read statically, never run) and what the report calls its source."""
    from verl_npu.preflight import launch as launch_reader

    if script is None:
        return launch_reader.launch_from_overrides(list(extra)), "<overrides>"
    return launch_reader.read_launch_script(script, list(extra), dict(env)), str(script)


def launch_checks(launch: Launch) -> list[Check]:
    checks = []
    for finding in launch.findings:  # the reader's messages name their line
        status = FAIL if finding.severity == "error" else WARN
        checks.append(Check(f"launch.{finding.code}", status, finding.message))
    if launch.module is not None:
        where = f"line {launch.trainer_line}" if launch.trainer_line else launch.source
        checks.append(Check("launch.trainer", OK, f"{launch.module} with {len(launch.overrides)} overrides ({where})"))
    return checks


def start_worker(
    script: str | Path | None, launch: Launch, model_config: str | None, use_cache: bool
) -> PreflightWorker:
    """torch, transformers and verl load meanwhile, in a child process (unless the answer is cached)."""
    from verl_npu.preflight.worker import PreflightWorker

    beside = Path(script).parent / "config.json" if script is not None else None
    beside_script = str(beside) if beside is not None and beside.is_file() else None
    return PreflightWorker(launch.config_name, list(launch.overrides), model_config, use_cache, beside_script)


def compose(report: PreflightReport, launch: Launch, worker: PreflightWorker) -> Any:
    """verl's DictConfig with the launch's overrides (None when it does not compose); a cached answer has it."""
    from verl_npu.preflight import config_check

    composed = worker.cached_composition()
    config, checks = composed or config_check.compose_config(launch.config_name, launch.overrides)
    report.checks += checks
    return config


def resolve(report: PreflightReport, config: Any) -> Mapping[str, Any] | None:
    """The composed config as plain containers, interpolations resolved (None when one does not resolve)."""
    from omegaconf.errors import OmegaConfBaseException

    from verl_npu.preflight import config_check

    try:
        return config_check.as_mapping(config)
    except OmegaConfBaseException as exc:
        report.checks.append(Check("config.interpolation", FAIL, f"a value does not resolve: {exc}"))
        return None


def validate(
    report: PreflightReport,
    worker: PreflightWorker,
    config: Any,
    compose_checks: list[Check],
    resolved: Mapping[str, Any],
    model_config: str | None,
    position: int,
) -> dict[str, Any] | None:
    """verl's own validation (reported at ``position``) and the model's HF config, both from the worker."""
    model_path = resolved["actor_rollout_ref"]["model"].get("path")
    hf, model_check, verl_checks, report.model_origin = worker.ask(config, model_path, model_config, compose_checks)
    report.checks[position:position] = verl_checks
    report.checks.append(model_check)
    return hf


def build_plans(
    report: PreflightReport, resolved: Mapping[str, Any], hf: Mapping[str, Any], where: Target
) -> dict[str, BuildPlan]:
    """Each Megatron role's build plan on the target's platform (every violated rule of every role reported)."""
    from verl_npu.preflight import config_check

    plans, checks = config_check.engine_plans(resolved, hf, where.platform)
    report.checks += checks
    return plans


def mesh(report: PreflightReport, resolved: Mapping[str, Any], shape: ModelShape) -> TrainMesh | None:
    """Every role's device mesh; the actor's (None when a mesh check failed)."""
    from verl_npu.preflight import mesh as mesh_checks

    checks, actor_mesh = mesh_checks.check_mesh(resolved, shape.num_layers, shape.num_experts)
    report.checks += checks
    return None if failed(checks) else actor_mesh


def memory(
    report: PreflightReport,
    resolved: Mapping[str, Any],
    shape: ModelShape,
    actor_mesh: TrainMesh,
    plan: BuildPlan,
    request: _Request,
) -> None:
    """The actor's HBM per pipeline stage and host RAM per node, as its build plan builds it on the target."""
    from verl_npu.dtypes import DtypeError
    from verl_npu.preflight.memory_plan import estimate_launch

    try:
        report.memory, checks = estimate_launch(
            resolved, shape, actor_mesh, plan, request.target, request.host_memory_gib
        )
    except DtypeError as exc:
        checks = [Check("memory.dtype", FAIL, f"actor: {exc}")]
    report.checks += checks
