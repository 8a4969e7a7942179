"""From a composed verl config to the memory estimate (verl_npu.preflight.memory) and its verdicts.

Reads the actor's settings the way verl 0.9.1's Megatron worker applies them: the micro-batch is
``ppo_max_token_len_per_gpu`` packed tokens with dynamic batch size, else
``ppo_micro_batch_size_per_gpu`` sequences of prompt + response length; recompute and the attention
kernel come from ``override_transformer_config`` (on Ascend MindSpeed's flash attention is on
unless ``use_flash_attn=False``); device capacity per chip comes from the stack manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_npu.contracts.mindspeed import DSA_SWITCHES
from verl_npu.preflight.checks import FAIL, OK, WARN, Check
from verl_npu.preflight.memory import Activations, GiB, MemoryEstimate, Offload, Parallelism, Precision, estimate
from verl_npu.preflight.mesh import TrainMesh
from verl_npu.preflight.model_shape import ModelShape, load_config

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}


def load_hf_config(source: Any) -> dict[str, Any]:
    """The HF config as a dict: a path, a model directory, an offline model id, or "glm5"."""
    return load_config(source)


def model_shape(hf: Mapping[str, Any]) -> ModelShape:
    return ModelShape.from_dict(dict(hf))


def describe_model(shape: ModelShape) -> dict[str, Any]:
    described = {
        "model_type": shape.model_type,
        "layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "experts": shape.num_experts,
        "total_params": shape.total_params(),
        "active_params": shape.active_params(),
    }
    if shape.dsa:
        kinds = shape.indexer_kinds()
        described["dsa_indexers"] = {
            "full": [i for i, kind in enumerate(kinds) if kind == "full"],
            "shared": [i for i, kind in enumerate(kinds) if kind == "shared"],
        }
    return described


def _dtype(value: Any, default: str) -> str:
    return _DTYPES.get(str(value), default) if value is not None else default


def estimate_launch(
    config: Mapping[str, Any],
    shape: ModelShape,
    mesh: TrainMesh,
    *,
    chip: str,
    host_memory_gib: float | None = None,
    platform: str = "ascend",
) -> tuple[MemoryEstimate, list[Check]]:
    from verl_npu.stack.manifest import load_stack

    stack = load_stack()
    if chip not in stack.chips:
        raise ValueError(f"chip {chip!r}: the stack manifest knows {', '.join(sorted(stack.chips))}")
    arr = config["actor_rollout_ref"]
    actor, rollout, data = arr["actor"], arr["rollout"], config["data"]
    mcore = actor["megatron"]
    otc = mcore.get("override_transformer_config") or {}
    ddp = mcore.get("override_ddp_config") or {}
    optim = actor.get("optim") or {}
    precision_aware = bool(optim.get("use_precision_aware_optimizer"))
    n = int(rollout.get("n") or 1)
    if actor.get("use_dynamic_bsz"):
        micro, seq = 1, int(actor["ppo_max_token_len_per_gpu"])
        microbatches = None
    else:
        micro = int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
        seq = int(data["max_prompt_length"]) + int(data["max_response_length"])
        microbatches = max(int(actor["ppo_mini_batch_size"]) * n // max(mesh.dp, 1) // micro, 1)
    flash = platform == "ascend" and otc.get("use_flash_attn", True) is not False
    # MindSpeed replaces DSAttention only with its fused DSA operators on; otherwise verl-npu's chunked patches run
    fused_dsa = platform == "ascend" and all(otc.get(flag) is True for flag in DSA_SWITCHES)
    parallelism = Parallelism(
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
    precision = Precision(
        params_dtype=_dtype(mcore.get("dtype"), "bf16"),
        grad_reduce_in_fp32=bool(ddp.get("grad_reduce_in_fp32", True)),
        use_distributed_optimizer=bool(mcore.get("use_distributed_optimizer", True)),
        use_precision_aware_optimizer=precision_aware,
        main_params_dtype=_dtype(optim.get("main_params_dtype"), "fp32"),
        main_grads_dtype=_dtype(optim.get("main_grads_dtype"), "fp32"),
        exp_avg_dtype=_dtype(optim.get("exp_avg_dtype"), "fp32"),
        exp_avg_sq_dtype=_dtype(optim.get("exp_avg_sq_dtype"), "fp32"),
    )
    activations = Activations(
        micro_batch_size=micro,
        seq_len=seq,
        num_microbatches=microbatches,
        recompute_granularity=otc.get("recompute_granularity"),
        recompute_method=otc.get("recompute_method"),
        recompute_num_layers=otc.get("recompute_num_layers"),
        attention_kernel="flash" if flash else "unfused",
        dsa_kernel="fused" if fused_dsa else "chunked",
    )
    offload = Offload(
        param_offload=bool(mcore.get("param_offload")), optimizer_offload=bool(mcore.get("optimizer_offload"))
    )
    colocated = arr.get("hybrid_engine", True)
    result = estimate(
        shape,
        parallelism,
        precision,
        activations,
        offload,
        capacity_bytes=stack.chips[chip].hbm_gib * GiB,
        rollout_gpu_memory_utilization=float(rollout.get("gpu_memory_utilization") or 0) if colocated else None,
        host_capacity_bytes=int(host_memory_gib * GiB) if host_memory_gib else None,
        platform=platform,
    )
    return result, memory_checks(result, offload, chip)


def memory_checks(result: MemoryEstimate, offload: Offload, chip: str) -> list[Check]:
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    capacity = result.capacity_bytes
    checks = []
    for stage in result.stages:
        room = result.headroom(stage)
        if room["train"] is not None and room["train"] < 0:
            checks.append(
                Check(
                    "memory",
                    f"stage{stage.stage}-train",
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
                    "memory",
                    f"stage{stage.stage}-rollout",
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
                "memory",
                "host",
                FAIL,
                f"node {result.worst_node} (stages {list(result.worst_node_stages)}) needs {gib(host)} of host RAM for "
                f"offloaded state, more than its {gib(result.host_capacity_bytes)}",
            )
        )
    if not checks:
        worst = max(result.stages, key=lambda s: s.train_bytes)
        checks.append(
            Check(
                "memory",
                "fits",
                OK,
                f"peak {gib(worst.train_bytes)} of {gib(capacity)} per device (stage {worst.stage}); host RAM "
                f"{gib(host)} on the busiest node",
            )
        )
        if result.host_capacity_bytes is None and host:
            checks.append(
                Check("memory", "host", WARN, "host RAM per node not checked: pass --host-memory-gib for your nodes")
            )
    return checks
