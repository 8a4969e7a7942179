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

from typing import TYPE_CHECKING

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.preflight.memory import Activations, GiB, MemoryEstimate, Offload, Parallelism, Precision, estimate
from verl_npu.preflight.mesh import TrainMesh
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.preflight.values import LaunchValues, MegatronRole

if TYPE_CHECKING:
    from verl_npu.engine.build_plan import BuildPlan
    from verl_npu.preflight.pipeline import Target


def estimate_launch(
    values: LaunchValues,
    shape: ModelShape,
    mesh: TrainMesh,
    plan: BuildPlan,
    target: Target,
    host_memory_gib: float | None = None,
    rollout_host_bytes_per_node: int = 0,
) -> tuple[MemoryEstimate, list[Check]]:
    """The actor's memory on ``target``, built the way ``plan`` (the actor's build plan) says.

    ``values`` is the launch's typed view (a Megatron actor); ``host_memory_gib``: host RAM per node (None: not
    checked; a given value is > 0, as the CLI and run_preflight parse it); ``rollout_host_bytes_per_node``: the
    rollout's sleep-mode weight copies on every node (verl_npu.preflight.rollout).
    """
    actor = values.actor
    if actor is None:
        raise ValueError(f"the memory estimate models a Megatron actor, not strategy {values.strategy!r}")
    offload = Offload(param_offload=actor.param_offload, optimizer_offload=actor.optimizer_offload)
    colocated = values.hybrid_engine
    result = estimate(
        shape,
        _parallelism(values, mesh),
        _precision(values, actor, plan),
        _activations(values, actor, mesh, plan),
        offload,
        capacity_bytes=target.hbm_bytes,
        rollout_gpu_memory_utilization=values.rollout.gpu_memory_utilization if colocated else None,
        host_capacity_bytes=int(host_memory_gib * GiB) if host_memory_gib is not None else None,
        platform=plan.platform,
        rollout_host_bytes_per_node=rollout_host_bytes_per_node,
    )
    return result, memory_checks(result, offload, target.chip)


def _parallelism(values: LaunchValues, mesh: TrainMesh) -> Parallelism:
    return Parallelism(
        tp=mesh.tp,
        pp=mesh.pp,
        cp=mesh.cp,
        ep=mesh.ep,
        etp=mesh.etp,
        world_size=mesh.world,
        sequence_parallel=mesh.sequence_parallel,
        vpp=mesh.vpp,
        num_layers_in_first_pipeline_stage=mesh.first_stage_layers,
        num_layers_in_last_pipeline_stage=mesh.last_stage_layers,
        devices_per_node=values.n_gpus_per_node,
    )


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
        **plan.optimizer_dtypes,
    )


def _activations(values: LaunchValues, actor: MegatronRole, mesh: TrainMesh, plan: BuildPlan) -> Activations:
    n = values.rollout.n
    if values.use_dynamic_bsz:
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
    return (
        f"{gib(result.host_bytes_per_node)} of offloaded actor state, {gib(result.rollout_host_bytes_per_node)} of "
        "the rollout's sleep-mode weight copies"
    )
