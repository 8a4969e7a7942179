"""From a launch's typed view and the actor's build plan to the memory estimate (verl_npu.preflight.memory).

Reads the actor's settings from the launch's typed view (:class:`verl_npu.preflight.values.LaunchValues`: every
value parsed and in range) the way verl 0.9.1's Megatron worker applies them: the micro-batch is
``ppo_max_token_len_per_gpu`` packed tokens with dynamic batch size, else ``ppo_micro_batch_size_per_gpu``
sequences of prompt + response length; recompute comes from ``override_transformer_config``. What the engine
decides is read from its build plan, never re-derived: the platform, the attention kernel (MindSpeed's flash
attention), the DSA kernel (MindSpeed's fused operators or verl-npu's chunked patches) and the optimizer's dtypes.
The device's capacity comes from the preflight target (the chip, from the stack manifest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.inputs import MAX_BATCH, MAX_PARALLEL
from verl_npu.parallelism import Parallelism
from verl_npu.preflight.memory import (
    Activations,
    GiB,
    MemoryEstimate,
    Offload,
    Precision,
    ReplayRoutes,
    estimate,
)
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.preflight.target import Target
from verl_npu.preflight.values import ROLLOUT, LaunchValues, MegatronRole, Reader

if TYPE_CHECKING:
    from verl_npu.engine.build_plan import BuildPlan


def estimate_launch(
    values: LaunchValues,
    shape: ModelShape,
    mesh: Parallelism,
    plan: BuildPlan,
    target: Target,
    host_memory_gib: float | None = None,
    rollout_host_bytes_per_node: int = 0,
    config: Mapping[str, Any] | None = None,
) -> tuple[MemoryEstimate, list[Check]]:
    """The actor's memory on ``target``, built the way ``plan`` (the actor's build plan) says.

    ``values`` is the launch's typed view (a Megatron actor), ``mesh`` the actor's parallelism (the mesh check
    passed it); ``host_memory_gib``: host RAM per node (None: not
    checked; a given value is > 0, as the CLI and run_preflight parse it); ``rollout_host_bytes_per_node``: the
    rollout's sleep-mode weight copies on every node (verl_npu.preflight.rollout); ``config``: the resolved verl
    config, for the routing replay routes kept with the batch (:func:`replay_routes`; None: not counted).
    """
    actor = values.actor
    if actor is None:
        raise ValueError(f"the memory estimate models a Megatron actor, not strategy {values.strategy!r}")
    offload = Offload(param_offload=actor.param_offload, optimizer_offload=actor.optimizer_offload)
    colocated = values.hybrid_engine
    result = estimate(
        shape,
        mesh,
        _precision(values, actor, plan),
        _activations(values, actor, mesh, plan),
        offload,
        capacity_bytes=target.hbm_bytes,
        rollout_gpu_memory_utilization=values.rollout.gpu_memory_utilization if colocated else None,
        host_capacity_bytes=int(host_memory_gib * GiB) if host_memory_gib is not None else None,
        platform=plan.platform,
        rollout_host_bytes_per_node=rollout_host_bytes_per_node,
        devices_per_node=values.n_gpus_per_node,
    )
    routes, route_checks = replay_routes(config, values, shape, mesh) if config is not None else (None, [])
    result = dataclasses.replace(result, replay_routes=routes)
    return result, route_checks + memory_checks(result, offload, target.chip)


def _precision(values: LaunchValues, actor: MegatronRole, plan: BuildPlan) -> Precision:
    # the engine merges the user's override_ddp_config over the build plan's
    grad_reduce_in_fp32 = actor.grad_reduce_in_fp32
    if grad_reduce_in_fp32 is None:
        grad_reduce_in_fp32 = bool(plan.ddp_overrides.get("grad_reduce_in_fp32", True))
    return Precision(
        params_dtype=actor.params_dtype,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        use_distributed_optimizer=actor.use_distributed_optimizer,
        use_precision_aware_optimizer=values.use_precision_aware_optimizer,
        main_params_dtype=values.main_params_dtype,
        # the plan's PRECISIONS keys (verl_npu.engine.build_plan), fp32 where it has none, as the plan reads unset
        main_grads_dtype=plan.optimizer_dtypes.get("main_grads_dtype", "fp32"),
        exp_avg_dtype=plan.optimizer_dtypes.get("exp_avg_dtype", "fp32"),
        exp_avg_sq_dtype=plan.optimizer_dtypes.get("exp_avg_sq_dtype", "fp32"),
    )


def _activations(values: LaunchValues, actor: MegatronRole, mesh: Parallelism, plan: BuildPlan) -> Activations:
    n = values.rollout.n
    if values.use_dynamic_bsz:
        if values.ppo_max_token_len_per_gpu is None:  # read_launch refuses a config like that
            raise ValueError(
                "use_dynamic_bsz needs actor_rollout_ref.actor.ppo_max_token_len_per_gpu set (its token budget)"
            )
        micro, seq, microbatches = 1, values.ppo_max_token_len_per_gpu, None
    else:
        micro = values.ppo_micro_batch_size_per_gpu or 1
        seq = values.max_sequence
        microbatches = max(values.ppo_mini_batch_size * n // max(mesh.dp, 1) // micro, 1)
    return Activations(
        micro_batch_size=micro,
        seq_len=seq,
        num_microbatches=microbatches,
        recompute_granularity=actor.recompute_granularity,
        recompute_method=actor.recompute_method,
        recompute_num_layers=actor.recompute_num_layers,
        attention_kernel="flash" if plan.flash_attention else "unfused",
        dsa_kernel="fused" if plan.fused_dsa else "chunked",
    )


def memory_checks(result: MemoryEstimate, offload: Offload, chip: str) -> list[Check]:
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    capacity = result.capacity_bytes
    checks = []
    for stage in result.stages:
        room = result.headroom(stage)
        if room["train"] is not None and room["train"] < 0:
            checks.append(
                Check(
                    f"memory.stage{stage.stage}-train",
                    FAIL,
                    f"stage {stage.stage}: the training step needs {gib(stage.train_bytes)} per device, the {chip} NPU "
                    f"has {gib(capacity)}; add pipeline/expert parallelism, recompute, or shorter micro-batches",
                )
            )
        if room["rollout"] is not None and room["rollout"] < 0:
            hint = (
                "enable megatron.param_offload and megatron.optimizer_offload"
                if not (offload.param_offload and offload.optimizer_offload)
                else "lower rollout.gpu_memory_utilization"
            )
            checks.append(
                Check(
                    f"memory.stage{stage.stage}-rollout",
                    FAIL,
                    f"stage {stage.stage}: during rollout the actor keeps {gib(stage.floor_bytes)} on the device and "
                    f"vLLM reserves {gib(result.rollout_reserved_bytes)}: {gib(result.rollout_bytes(stage))} of "
                    f"{gib(capacity)}; {hint}",
                )
            )
    host = result.node_host_bytes
    if result.host_capacity_bytes is not None and host > result.host_capacity_bytes:
        checks.append(
            Check(
                "memory.host",
                FAIL,
                f"node {result.worst_node} (stages {list(result.worst_node_stages)}) needs {gib(host)} of host RAM "
                f"({_host_parts(result)}), more than its {gib(result.host_capacity_bytes)}",
            )
        )
    if not checks:
        worst = max(result.stages, key=lambda s: s.train_bytes)
        checks.append(
            Check(
                "memory.fits",
                OK,
                f"peak {gib(worst.train_bytes)} of {gib(capacity)} per device (stage {worst.stage}); host RAM "
                f"{gib(host)} on the busiest node ({_host_parts(result)})",
            )
        )
        if result.host_capacity_bytes is None and host:
            checks.append(
                Check("memory.host", WARN, "host RAM per node not checked: pass --host-memory-gib for your nodes")
            )
    return checks


def _host_parts(result: MemoryEstimate) -> str:
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    parts = (
        f"{gib(result.host_bytes_per_node)} of offloaded actor state, {gib(result.rollout_host_bytes_per_node)} of "
        "the rollout's sleep-mode weight copies"
    )
    if result.replay_routes is not None:
        parts += f", {gib(result.routes_host_bytes_per_node)} of routing replay routes"
    return parts


# --- routing replay's routes in the batch (verl_npu.preflight.memory.ReplayRoutes) --------------------------------
ROUTES_CHECK = "memory.replay-routes"
TRANSFER_QUEUE = "transfer_queue.backend"
# verl 0.9.1's trainer defaults (its ppo_trainer config): the v1 trainer, TransferQueue's SimpleStorage of 8 units
USE_V1 = "trainer.use_v1"
STORAGE_BACKEND = f"{TRANSFER_QUEUE}.storage_backend"
STORAGE_UNITS = f"{TRANSFER_QUEUE}.SimpleStorage.num_data_storage_units"
LOAD_BALANCE_METRICS = f"{ROLLOUT}.moe_load_balance_metrics_interval"


def replay_routes(
    config: Mapping[str, Any], values: LaunchValues, shape: ModelShape, mesh: Parallelism
) -> tuple[ReplayRoutes | None, list[Check]]:
    """The MoE routes verl keeps with the step's samples, and a check showing them (None, []: no routes kept).

    Routes are kept when the rollout returns them (``enable_rollout_routing_replay`` with vLLM; R3 replays them, and
    they are kept whatever the mode) or when R2's old-log-prob pass records them (a batch without the rollout's
    routes). The rules behind each number are :class:`verl_npu.preflight.memory.ReplayRoutes`' and
    docs/preflight_rollout.md's ("Routing replay"); the rollout's layout rests on contracts
    vllm-routes-capturer-buffer and vllm-routes-per-request-prompt-then-forwarded-tokens.
    """
    from verl_npu.preflight.router_replay import MODES, ROLLOUT_NAME, ROLLOUT_ROUTES, ROUTE_RETURNING_ROLLOUTS, mode_key

    r = Reader(config)
    mode = r.choice(mode_key("actor"), MODES, default="disabled")
    returns = r.boolean(ROLLOUT_ROUTES, default=False)
    name = r.text(ROLLOUT_NAME, default=None, max_length=64)
    if r.errors:
        return None, [
            Check(
                ROUTES_CHECK,
                WARN,
                "the routing replay routes kept with the batch were not estimated: the replay keys are not readable "
                "(router-replay.value above); the host RAM estimate leaves them out",
            )
        ]
    rollout_routes = bool(returns) and name in ROUTE_RETURNING_ROLLOUTS
    recorded = mode == "R2" and not rollout_routes  # the engine records only into a batch without routes
    if not (rollout_routes or recorded) or not (shape.num_experts and shape.router_topk):
        return None, []  # nothing kept (a model without routed experts is router-replay.model's FAIL)
    if rollout_routes and name != "vllm":
        return None, [
            Check(
                ROUTES_CHECK,
                WARN,
                f"{ROLLOUT_NAME}={name}: the routes it returns were not estimated (the verl-npu stack pins no {name}); "
                "the host RAM estimate leaves them out",
            )
        ]
    use_v1 = r.boolean(USE_V1, default=True)
    backend = r.text(STORAGE_BACKEND, default="SimpleStorage", max_length=64)
    units = r.integer(STORAGE_UNITS, 1, MAX_PARALLEL, default=8)
    interval = r.integer(LOAD_BALANCE_METRICS, 0, MAX_BATCH, default=0)
    if r.errors:
        return None, [Check(ROUTES_CHECK, FAIL, str(e), fix=f"set {getattr(e, 'key', 'it')} to a valid value")
                      for e in r.errors]  # fmt: skip
    routes = ReplayRoutes(
        mode=mode or "disabled",
        recorded=recorded,
        layers=sum(shape.is_moe) if recorded else shape.num_layers,
        top_k=shape.router_topk,
        samples=values.train_batch_size * values.rollout.n,
        tokens_per_sample=values.max_sequence,
        data_parallel=mesh.dp,
        mini_batch_samples=values.ppo_mini_batch_size * values.rollout.n,
        storage_units=units or 8,
        nodes=values.nnodes,
        devices_per_node=values.n_gpus_per_node,
        driver_fetches=bool(interval),
    )
    where = _where_the_batch_lives(use_v1, backend)
    if where is not None:
        return None, [
            Check(
                ROUTES_CHECK,
                WARN,
                f"{_routes_kept(routes)}, {_gib(routes.batch_bytes)} for the step's {routes.samples:,} samples; "
                f"{where}, so the host RAM estimate leaves them out",
            )
        ]
    return routes, [Check(ROUTES_CHECK, OK, _routes_detail(routes))]


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _where_the_batch_lives(use_v1: bool | None, backend: str | None) -> str | None:
    """Why the routes' place in host RAM is not modelled (None: verl's v1 trainer over SimpleStorage, modelled)."""
    if not use_v1:
        return (
            f"with {USE_V1}=False verl's legacy trainer holds the batch in its driver and ships the shares through "
            "Ray's object store, which preflight does not model"
        )
    if backend != "SimpleStorage":
        return f"{STORAGE_BACKEND}={backend}: preflight models TransferQueue's SimpleStorage only"
    return None


def _routes_kept(routes: ReplayRoutes) -> str:
    if routes.recorded:
        what = f"R2: the old-log-prob pass records the routes of the {routes.layers} MoE layers"
    else:
        mode = "R3 replays them" if routes.mode == "R3" else f"the replay mode is {routes.mode}"
        what = f"the rollout returns every token's routes over all {routes.layers} decoder layers ({mode})"
    return (
        f"{what}, and verl keeps them with each sample as int16 [tokens, {routes.layers}, top-{routes.top_k}]: "
        f"{routes.bytes_per_token:,} B per token, up to {routes.sample_bytes / 2**20:,.1f} MiB per sample of "
        f"{routes.tokens_per_sample:,} tokens"
    )


def _routes_detail(routes: ReplayRoutes) -> str:
    share, mini = routes.samples_per_process, routes.mini_batch_samples_per_process
    detail = (
        f"{_routes_kept(routes)}. The step's {routes.samples:,} samples: {_gib(routes.batch_bytes)} in TransferQueue's "
        f"{routes.storage_units} storage units over {routes.nodes} nodes ({routes.storage_samples_per_node:,} "
        f"samples, {_gib(routes.storage_bytes_per_node)}, on the busiest); each training process fetches its "
        f"data-parallel share ({share:,} samples, DP {routes.data_parallel}) and copies it into micro-batches (the "
        f"update: into mini-batches of {mini:,}, then micro-batches), up to {routes.process_samples:,} samples' routes "
        f"at once: {_gib(routes.process_bytes)} x {routes.devices_per_node} processes per node = "
        f"{_gib(routes.process_bytes_per_node)}"
    )
    if routes.driver_fetches:
        detail += (
            f"; {LOAD_BALANCE_METRICS} > 0: the driver fetches the whole step's routes and pads them "
            f"({_gib(routes.driver_bytes)}, after the update)"
        )
    return detail + f". Up to {_gib(routes.bytes_per_node)} on the busiest node, counted in its host RAM below"
