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
from verl_npu.errors import UserError
from verl_npu.preflight.model import FROM_BESIDE_SCRIPT, FROM_NAME
from verl_npu.preflight.report import PreflightReport
from verl_npu.preflight.target import Target, target

if TYPE_CHECKING:
    import subprocess

    from verl_npu.engine.build_plan import BuildPlan
    from verl_npu.parallelism import Parallelism
    from verl_npu.preflight.compose import ConfigSearch
    from verl_npu.preflight.launch import Launch
    from verl_npu.preflight.model_shape import ModelShape
    from verl_npu.preflight.values import LaunchValues
    from verl_npu.preflight.worker import PreflightWorker


def host_memory(gib: Any) -> float | None:
    """``--host-memory-gib``: a finite number of GiB > 0 (None: not given; 0 is not "not given")."""
    from verl_npu import inputs

    return None if gib is None else inputs.number("--host-memory-gib", gib, above=0, maximum=inputs.MAX_GIB)


@dataclasses.dataclass(frozen=True)
class _Request:
    """One preflight's inputs besides the launch."""

    target: Target
    model_config: str | None
    env: Mapping[str, str]
    host_memory_gib: float | None
    checkpoint_read_gbps: float | None = None  # --checkpoint-read-gbps: the nodes' disk rate (GB/s)


@dataclasses.dataclass(frozen=True)
class _Composition:
    """What Hydra composes: the config name, the overrides (placeholders as sentinels) and where the configs are."""

    config_name: str | None
    overrides: tuple[str, ...]
    search: ConfigSearch
    unknowns: Mapping[str, str]  # sentinel -> the placeholder it stands for (verl_npu.preflight.unknowns)


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
    checkpoint_read_gbps: float | None = None,
    child: subprocess.Popen[bytes] | None = None,
) -> PreflightReport:
    """Every check on one launch: a script (``extra`` are its "$@") or, without a script, overrides.

    ``host_memory_gib``: host RAM per node (> 0; None: not checked); ``checkpoint_read_gbps``: the rate a node reads
    the checkpoint at, GB/s (> 0; None: sampled from a local checkpoint, else the start-up is not estimated);
    ``child``: a worker process the caller started (verl_npu.preflight.worker.start_child; None: one is started
    here), ended here unless it answers. Raises a UserError for a bad option or launch.
    """
    from verl_npu import processes
    from verl_npu.preflight.startup import read_rate
    from verl_npu.preflight.worker import start_child

    if child is None:  # first: its imports are a cold check's critical path (ended if the answer is cached)
        child = start_child()
    try:
        host_memory_gib = host_memory(host_memory_gib)
        checkpoint_read_gbps = read_rate(checkpoint_read_gbps)
        launch, source = read_launch(script, extra, dict(env or {}))
        report = PreflightReport(source, chip, launch_checks(launch), list(launch.overrides))
        composition = composition_of(report, launch) if launch.module is not None else None
        if composition is None:
            target(chip, platform)  # an unknown chip or platform is an error whatever the launch
            return report
        worker = start_worker(script, composition, model_config, use_cache, child)
        try:
            request = _Request(
                target(chip, platform), model_config, dict(env or {}), host_memory_gib, checkpoint_read_gbps
            )
            _check(report, launch, composition, worker, request)
        finally:
            worker.cancel()
    finally:
        if child.poll() is None:  # not handed to a worker (a bad launch, a cached answer) or left by an error
            processes.end_group(child, grace=0.5)
    _show_placeholders(report, composition.unknowns)
    return report


def _show_placeholders(report: PreflightReport, mapping: Mapping[str, str]) -> None:
    """Every message that quotes a sentinel shows the launch's placeholder instead (verl_npu.preflight.unknowns)."""
    from verl_npu.preflight import unknowns

    report.checks[:] = [
        dataclasses.replace(c, detail=unknowns.restore(c.detail, mapping), fix=unknowns.restore(c.fix, mapping))
        for c in report.checks
    ]


def _check(
    report: PreflightReport, launch: Launch, composition: _Composition, worker: PreflightWorker, request: _Request
) -> None:
    """Compose, read the values, validate, build plans, mesh, memory: each step adds its checks.

    Every value the later steps compute with is parsed first (:mod:`verl_npu.preflight.values` for the launch,
    :meth:`ModelShape.from_dict` for the model): one FAIL check per bad value, and then no step computes with them.
    """
    from verl_npu.preflight import engine_checks
    from verl_npu.preflight.router_replay import router_replay_checks
    from verl_npu.preflight.values import read_model_path

    before = len(report.checks)
    config = compose(report, composition, worker)
    if config is None:
        return
    position = len(report.checks)  # verl's own validation is reported right after composition
    compose_checks = report.checks[before:position]
    resolved = resolve(report, config)
    if resolved is None:
        return
    values = launch_values(report, resolved)
    model_path, path_checks = read_model_path(resolved)
    report.checks += path_checks
    launch_env = {**request.env, **launch.env}
    report.checks += engine_checks.rollout_environment_checks(resolved, launch_env)
    if worker.running:
        _prefetch()
    hf = validate(report, worker, config, compose_checks, model_path, request.model_config, position)
    if hf is None:
        report.checks += timeout_ranges(launch_env)
        return
    stand_in = report.model_origin in (FROM_BESIDE_SCRIPT, FROM_NAME)  # the model path's name is evidence too
    platform = request.target.platform
    report.checks += engine_checks.rollout_model_checks(resolved, hf, launch_env, platform, model_path, stand_in)
    report.checks += router_replay_checks(resolved, hf, launch_env, platform)
    shape = model_shape(report, hf)
    if values is None or shape is None:
        report.checks += timeout_ranges(launch_env)
        report.checks.append(
            Check(
                "config.not-computed",
                WARN,
                "the engine's build plans, the device mesh and the memory estimate were not computed: fix the "
                "values above first (no step computes with a value out of range)",
            )
        )
        return
    plans = build_plans(report, resolved, values, hf, request.target)
    actor_mesh = mesh(report, values, shape)
    rollout_host = rollout(report, values, shape, launch_env, request.target)
    if values.actor is None:
        report.checks.append(
            Check(
                "memory.not-checked",
                WARN,
                f"actor strategy {values.strategy}: the memory estimate models "
                "Megatron engines only; no HBM or host RAM estimate",
            )
        )
    elif actor_mesh is not None and "actor" in plans:
        memory(report, values, shape, actor_mesh, plans["actor"], request, rollout_host, resolved)
    if values.actor is not None and actor_mesh is not None:
        startup(report, values, shape, hf, actor_mesh, request, checkpoint_dir(model_path, request.model_config),
                launch_env)  # fmt: skip
    else:  # the loader modelled is the Megatron engine's: the values are still range-checked
        report.checks += timeout_ranges(launch_env)


def _prefetch() -> None:
    """Import what the steps after verl's validation need while the worker imports verl (the parent waits anyway)."""
    import rich.console
    import rich.table  # noqa: F401

    import verl_npu.engine.build_plan
    import verl_npu.preflight.memory_plan
    import verl_npu.preflight.rollout  # noqa: F401


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


def composition_of(report: PreflightReport, launch: Launch) -> _Composition | None:
    """What Hydra composes for the launch (None, with a FAIL check, when --config-path/--config-dir are unusable)."""
    from verl_npu.preflight import compose

    try:
        search = compose.config_search(launch.config_path, launch.config_dir, launch.unknowns)
    except compose.ConfigSearchError as exc:
        report.checks.append(Check("config.config-path", FAIL, str(exc)))
        return None
    overrides, mapping = launch.hydra_overrides()
    return _Composition(launch.config_name, overrides, search, mapping)


def start_worker(
    script: str | Path | None,
    composition: _Composition,
    model_config: str | None,
    use_cache: bool,
    child: subprocess.Popen[bytes] | None = None,
) -> PreflightWorker:
    """torch, transformers and verl load meanwhile, in ``child`` (verl_npu.preflight.worker.start_child), unless the
    answer is cached."""
    from verl_npu.preflight.worker import PreflightWorker

    beside = Path(script).parent / "config.json" if script is not None else None
    beside_script = str(beside) if beside is not None and beside.is_file() else None
    c = composition
    return PreflightWorker(c.config_name, list(c.overrides), model_config, use_cache, beside_script,
                           c.search.directories, child)  # fmt: skip


def compose(report: PreflightReport, composition: _Composition, worker: PreflightWorker) -> Any:
    """verl's DictConfig with the launch's overrides (None when it does not compose); a cached answer has it."""
    from verl_npu.preflight import compose

    c = composition
    composed = worker.cached_composition()
    config, checks = composed or compose.compose_config(c.config_name, c.overrides, c.search)
    report.checks += checks
    return config


def resolve(report: PreflightReport, config: Any) -> Mapping[str, Any] | None:
    """The composed config as plain containers, interpolations resolved (None when one does not resolve)."""
    from omegaconf.errors import OmegaConfBaseException

    from verl_npu.preflight import compose

    try:
        return compose.as_mapping(config)
    except OmegaConfBaseException as exc:
        report.checks.append(Check("config.interpolation", FAIL, f"a value does not resolve: {exc}"))
        return None


def launch_values(report: PreflightReport, resolved: Mapping[str, Any]) -> LaunchValues | None:
    """The launch's typed view (None, with a FAIL check per bad value, when a value is missing or out of range)."""
    from verl_npu.preflight.values import read_launch

    values, checks = read_launch(resolved)
    report.checks += checks
    return values


def validate(
    report: PreflightReport,
    worker: PreflightWorker,
    config: Any,
    compose_checks: list[Check],
    model_path: str | None,
    model_config: str | None,
    position: int,
) -> dict[str, Any] | None:
    """verl's own validation (reported at ``position``) and the model's HF config, both from the worker."""
    hf, model_check, verl_checks, report.model_origin = worker.ask(config, model_path, model_config, compose_checks)
    report.checks[position:position] = verl_checks
    report.checks.append(model_check)
    return hf


def model_shape(report: PreflightReport, hf: Mapping[str, Any]) -> ModelShape | None:
    """The model's shape (None, with a FAIL check per bad value, when the config has values out of range)."""
    from verl_npu.preflight.model_shape import ModelShape
    from verl_npu.preflight.values import InputErrors

    try:
        shape = ModelShape.from_dict(hf)
    except InputErrors as exc:
        report.checks += [Check("config.model-value", FAIL, str(error)) for error in exc.errors]
        return None
    except UserError as exc:  # the config is not a mapping at all
        report.checks.append(Check("config.model-value", FAIL, str(exc)))
        return None
    report.model = shape.describe()
    return shape


def build_plans(
    report: PreflightReport, resolved: Mapping[str, Any], values: LaunchValues, hf: Mapping[str, Any], where: Target
) -> dict[str, BuildPlan]:
    """Each Megatron role's build plan on the target's platform (every violated rule of every role reported)."""
    from verl_npu.preflight import engine_checks

    plans, checks = engine_checks.engine_plans(resolved, values, hf, where.platform)
    report.checks += checks
    return plans


def mesh(report: PreflightReport, values: LaunchValues, shape: ModelShape) -> Parallelism | None:
    """Every role's device mesh; the actor's (None when a mesh check failed, or the actor is not Megatron)."""
    from verl_npu.preflight import mesh as mesh_checks

    checks, actor_mesh = mesh_checks.check_mesh(values, shape.num_layers, shape.num_experts)
    report.checks += checks
    return None if failed(checks) else actor_mesh


def rollout(
    report: PreflightReport, values: LaunchValues, shape: ModelShape, env: Mapping[str, str], where: Target
) -> int:
    """The vLLM rollout: its KV cache fit, graph capture vs the weight sync, and the host RAM its sleep-mode
    weight copies take on a node (returned; 0 when not computed). Not computed when the rollout's mesh failed."""
    from verl_npu.preflight.rollout import rollout_checks

    if any(c.check in ("mesh.rollout-replica", "mesh.rollout-ep") and c.status == FAIL for c in report.checks):
        return 0
    v = values
    report.rollout, checks = rollout_checks(shape, v.rollout, env, where.hbm_bytes, v.n_gpus_per_node,
                                            v.max_prompt_length, v.max_response_length, where.platform)  # fmt: skip
    report.checks += checks
    return report.rollout.host_bytes_per_node if report.rollout is not None else 0


def memory(
    report: PreflightReport,
    values: LaunchValues,
    shape: ModelShape,
    actor_mesh: Parallelism,
    plan: BuildPlan,
    request: _Request,
    rollout_host_bytes_per_node: int = 0,
    resolved: Mapping[str, Any] | None = None,
) -> None:
    """The actor's HBM per pipeline stage and host RAM per node (with the rollout's sleep-mode copies and the routing
    replay routes the resolved config keeps), as its build plan builds it on the target."""
    from verl_npu.preflight.memory_plan import estimate_launch

    report.memory, checks = estimate_launch(values, shape, actor_mesh, plan, request.target, request.host_memory_gib,
                                            rollout_host_bytes_per_node, resolved)  # fmt: skip
    report.checks += checks


def checkpoint_dir(model_path: str | None, model_config: str | None) -> str | None:
    """The HF checkpoint directory on this machine: the launch's model path, else --model-config's directory."""
    from verl_npu.bounded_read import NotReadable, expand_user
    from verl_npu.preflight import unknowns

    for candidate in (model_path, model_config):
        if not isinstance(candidate, str) or unknowns.contains(candidate):
            continue
        try:
            if (path := expand_user(candidate)).is_dir():
                return str(path)
        except (NotReadable, OSError, ValueError):
            continue
    return None


def timeout_ranges(env: Mapping[str, str]) -> list[Check]:
    """HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT range-checked where there is no start-up estimate to compare with."""
    from verl_npu.preflight.startup import timeout_checks

    return timeout_checks(None, env)


def startup(
    report: PreflightReport,
    values: LaunchValues,
    shape: ModelShape,
    hf: Mapping[str, Any],
    actor_mesh: Parallelism,
    request: _Request,
    checkpoint: str | None,
    env: Mapping[str, str],
) -> None:
    """The checkpoint bytes each node loads at start-up, the load's time, and the HCCL timeouts it needs."""
    from verl_npu.preflight.startup import estimate_startup, timeout_checks

    report.startup, checks = estimate_startup(
        shape,
        hf,
        actor_mesh,
        values.n_gpus_per_node,
        read_gbps=request.checkpoint_read_gbps,
        checkpoint_dir=checkpoint,
    )
    report.checks += checks + timeout_checks(report.startup, env)
