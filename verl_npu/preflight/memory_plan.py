"""From a composed verl config and the actor's build plan to the memory estimate (verl_npu.preflight.memory).

Reads the actor's settings the way verl 0.9.1's Megatron worker applies them: the micro-batch is
``ppo_max_token_len_per_gpu`` packed tokens with dynamic batch size, else
``ppo_micro_batch_size_per_gpu`` sequences of prompt + response length; recompute comes from
``override_transformer_config``. What the engine decides is read from its build plan, never re-derived:
the platform, the attention kernel (MindSpeed's flash attention), the DSA kernel (MindSpeed's fused
operators or verl-npu's chunked patches) and the optimizer's dtypes. The device's capacity comes from
the preflight target (the chip, from the stack manifest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.dtypes import parse
from verl_npu.preflight.memory import Activations, GiB, MemoryEstimate, Offload, Parallelism, Precision, estimate
from verl_npu.preflight.mesh import TrainMesh
from verl_npu.preflight.model_shape import ModelShape

if TYPE_CHECKING:
    from verl_npu.engine.build_plan import BuildPlan
    from verl_npu.preflight.pipeline import Target


def estimate_launch(
    config: Mapping[str, Any],
    shape: ModelShape,
    mesh: TrainMesh,
    plan: BuildPlan,
    target: Target,
    host_memory_gib: float | None = None,
) -> tuple[MemoryEstimate, list[Check]]:
    """The actor's memory on ``target``, built the way ``plan`` (the actor's build plan) says.

    Raises verl_npu.dtypes.DtypeError for a dtype spelling nobody knows.
    """
    arr = config["actor_rollout_ref"]
    rollout, mcore = arr["rollout"], arr["actor"]["megatron"]
    offload = Offload(
        param_offload=bool(mcore.get("param_offload")), optimizer_offload=bool(mcore.get("optimizer_offload"))
    )
    colocated = arr.get("hybrid_engine", True)
    result = estimate(
        shape,
        _parallelism(config, mesh),
        _precision(arr["actor"], plan),
        _activations(config, mesh, plan),
        offload,
        capacity_bytes=target.hbm_bytes,
        rollout_gpu_memory_utilization=float(rollout.get("gpu_memory_utilization") or 0) if colocated else None,
        host_capacity_bytes=int(host_memory_gib * GiB) if host_memory_gib else None,
        platform=plan.platform,
    )
    return result, memory_checks(result, offload, target.chip)


def _parallelism(config: Mapping[str, Any], mesh: TrainMesh) -> Parallelism:
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
        devices_per_node=int(config["trainer"]["n_gpus_per_node"]),
    )


def _precision(actor: Mapping[str, Any], plan: BuildPlan) -> Precision:
    mcore, optim = actor["megatron"], actor.get("optim") or {}
    ddp = {**plan.ddp_overrides, **(mcore.get("override_ddp_config") or {})}  # as the engine merges them
    return Precision(
        params_dtype=parse(mcore.get("dtype"), "bf16", "megatron.dtype"),
        grad_reduce_in_fp32=bool(ddp.get("grad_reduce_in_fp32", True)),
        use_distributed_optimizer=bool(mcore.get("use_distributed_optimizer", True)),
        use_precision_aware_optimizer=bool(optim.get("use_precision_aware_optimizer")),
        main_params_dtype=parse(optim.get("main_params_dtype"), "fp32", "optim.main_params_dtype"),
        **plan.optimizer_dtypes,
    )


def _activations(config: Mapping[str, Any], mesh: TrainMesh, plan: BuildPlan) -> Activations:
    actor, data = config["actor_rollout_ref"]["actor"], config["data"]
    otc = actor["megatron"].get("override_transformer_config") or {}
    n = int(config["actor_rollout_ref"]["rollout"].get("n") or 1)
    if actor.get("use_dynamic_bsz"):
        micro, seq, microbatches = 1, int(actor["ppo_max_token_len_per_gpu"]), None
    else:
        micro = int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
        seq = int(data["max_prompt_length"]) + int(data["max_response_length"])
        microbatches = max(int(actor["ppo_mini_batch_size"]) * n // max(mesh.dp, 1) // micro, 1)
    return Activations(
        micro_batch_size=micro,
        seq_len=seq,
        num_microbatches=microbatches,
        recompute_granularity=otc.get("recompute_granularity"),
        recompute_method=otc.get("recompute_method"),
        recompute_num_layers=otc.get("recompute_num_layers"),
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
    host = result.host_bytes_per_node
    if result.host_capacity_bytes is not None and host > result.host_capacity_bytes:
        checks.append(
            Check(
                "memory.host",
                FAIL,
                f"node {result.worst_node} (stages {list(result.worst_node_stages)}) needs {gib(host)} of host RAM for "
                f"offloaded state, more than its {gib(result.host_capacity_bytes)}",
            )
        )
    if not checks:
        worst = max(result.stages, key=lambda s: s.train_bytes)
        checks.append(
            Check(
                "memory.fits",
                OK,
                f"peak {gib(worst.train_bytes)} of {gib(capacity)} per device (stage {worst.stage}); host RAM "
                f"{gib(host)} on the busiest node",
            )
        )
        if result.host_capacity_bytes is None and host:
            checks.append(
                Check("memory.host", WARN, "host RAM per node not checked: pass --host-memory-gib for your nodes")
            )
    return checks
