"""The NPU Megatron engine's build plan: a pure function of verl's configs and the HF config.

It decides which features are on (fused RMSNorm, DSA, offload, precision-aware optimizer), the
TransformerConfig and DDP overrides that implement them, and the MindSpeed ``repatch`` arguments on
Ascend. Every invalid combination raises :class:`BuildPlanError` naming the keys, the rule and a
valid alternative. Preflight (launch checking) runs the same function.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

OTC = "override_transformer_config"
DSA_FUSED_FLAGS = (
    "use_fused_lightning_indexer",
    "use_fused_sparse_flash_attention",
    "use_fused_lightning_indexer_kl_loss",
)
FUSED_KL_LOSS_HEADS = (32, 64, 128)
KV_ALLGATHER = "kvallgather_cp_algo"
# Keys that MindSpeed reads from its arguments; megatron-core's TransformerConfig has no such field.
MINDSPEED_ONLY_KEYS = (
    "use_fused_rmsnorm",
    "use_fused_swiglu",
    "use_flash_attn",
    "context_parallel_algo",
    "use_dsa_absorb",
    *DSA_FUSED_FLAGS,
)
PRECISIONS = {
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}


_DTYPE_ALIASES = {
    "None": "fp32",
    "32": "fp32",
    "float32": "fp32",
    "fp32": "fp32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "16": "fp16",
    "fp16": "fp16",
    "fp8": "fp8",
}


class BuildPlanError(ValueError):
    """An invalid combination of engine settings (names the keys, the rule and an alternative)."""


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    platform: str
    features: tuple[str, ...]
    transformer_overrides: Mapping[str, Any]
    ddp_overrides: Mapping[str, Any]
    mindspeed_repatch: Mapping[str, Any] | None
    rmsnorm_impl: str | None
    notes: tuple[str, ...]


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _fail(keys: str, rule: str, alternative: str) -> None:
    raise BuildPlanError(f"{keys}: {rule}. Instead: {alternative}")


def _normalization(otc: Mapping[str, Any], hf_config: Any) -> tuple[str, str]:
    if "normalization" in otc:
        return otc["normalization"], f"{OTC}.normalization"
    if _get(hf_config, "rms_norm_eps") is not None:
        return "RMSNorm", "the HF config (rms_norm_eps)"
    return "LayerNorm", "the HF config (no rms_norm_eps)"


def _is_dsa(otc: Mapping[str, Any], hf_config: Any) -> bool:
    return otc.get("experimental_attention_variant") == "dsa" or _get(hf_config, "index_topk") is not None


def build_plan(engine_config: Any, optimizer_config: Any, hf_config: Any, platform: str) -> BuildPlan:
    """Validate and translate verl's McoreEngineConfig / McoreOptimizerConfig for our engine."""
    if platform not in ("ascend", "cuda", "cpu"):
        raise BuildPlanError(f"platform {platform!r}: must be ascend, cuda or cpu")
    if not _get(engine_config, "vanilla_mbridge", False) and importlib.util.find_spec("megatron.bridge") is None:
        _fail(
            "megatron.vanilla_mbridge=False",
            "verl 0.9.1 then builds models with Megatron-Bridge (megatron.bridge), which the verl-npu stack does "
            "not ship (it pins mbridge 0.15.1, patched for megatron-core 0.18)",
            "set actor_rollout_ref.actor.megatron.vanilla_mbridge=True (and ref/critic alike)",
        )
    otc = dict(_get(engine_config, OTC) or {})
    user_ddp = dict(_get(engine_config, "override_ddp_config") or {})
    features: list[str] = []
    notes: list[str] = []
    tf: dict[str, Any] = {k: v for k, v in otc.items() if k not in MINDSPEED_ONLY_KEYS}
    ddp: dict[str, Any] = {}
    repatch: dict[str, Any] = {k: otc[k] for k in MINDSPEED_ONLY_KEYS if k in otc}
    rmsnorm_impl = None

    # --- fused RMSNorm -------------------------------------------------------------------------
    if otc.get("use_fused_rmsnorm"):
        norm, source = _normalization(otc, hf_config)
        if norm != "RMSNorm":
            _fail(
                f"{OTC}.use_fused_rmsnorm=True",
                f"fused RMSNorm requires normalization='RMSNorm', but {source} gives {norm!r}",
                f"remove {OTC}.use_fused_rmsnorm for this model",
            )
        tf["normalization"] = "RMSNorm"
        rmsnorm_impl = "torch_npu.npu_rms_norm" if platform == "ascend" else "verl_npu.ops.rmsnorm.RMSNorm"
        features.append("fused_rmsnorm")
        notes.append(f"fused RMSNorm -> {rmsnorm_impl}")

    # --- DSA -----------------------------------------------------------------------------------
    fused_set = [flag for flag in DSA_FUSED_FLAGS if otc.get(flag)]
    if _is_dsa(otc, hf_config):
        features.append("dsa")
        if _get(hf_config, "kv_lora_rank") is None and not otc.get("multi_latent_attention"):
            _fail(
                f"{OTC}.experimental_attention_variant='dsa'",
                "DSA (DeepSeek sparse attention) requires multi-latent attention, and this model has no kv_lora_rank",
                "use an MLA model (DeepSeek-V3.2, GLM-5) or drop experimental_attention_variant",
            )
        if otc.get("qk_layernorm") is False:
            _fail(
                f"{OTC}.qk_layernorm=False",
                "DSA requires qk_layernorm",
                f"remove {OTC}.qk_layernorm (the engine enables it for DSA)",
            )
        if otc.get("apply_rope_fusion"):
            _fail(
                f"{OTC}.apply_rope_fusion=True",
                "megatron-core's DSA asserts apply_rope_fusion=False",
                f"remove {OTC}.apply_rope_fusion",
            )
        if _get(engine_config, "use_remove_padding", False):
            _fail(
                "use_remove_padding=True",
                "DSA does not support packed (THD) input in megatron-core 0.18",
                "set actor_rollout_ref.actor.megatron.use_remove_padding=False (and ref/critic alike)",
            )
        tf.update(
            experimental_attention_variant="dsa",
            multi_latent_attention=True,
            qk_layernorm=True,
            apply_rope_fusion=False,
        )
        for ours, theirs in (
            ("dsa_indexer_n_heads", "index_n_heads"),
            ("dsa_indexer_head_dim", "index_head_dim"),
            ("dsa_indexer_topk", "index_topk"),
        ):
            if ours not in tf and _get(hf_config, theirs) is not None:
                tf[ours] = _get(hf_config, theirs)
        cp = int(_get(engine_config, "context_parallel_size", 1) or 1)
        if cp > 1:
            if platform != "ascend":
                _fail(
                    f"context_parallel_size={cp} with DSA",
                    "megatron-core 0.18's DSA asserts context_parallel_size=1 (only MindSpeed on Ascend shards it)",
                    "use context_parallel_size=1 off Ascend",
                )
            if otc.get("context_parallel_algo") != KV_ALLGATHER:
                _fail(
                    f"context_parallel_size={cp} with DSA, {OTC}.context_parallel_algo="
                    f"{otc.get('context_parallel_algo')!r}",
                    "DSA with context parallelism needs the kv-allgather CP algorithm",
                    f"set {OTC}.context_parallel_algo={KV_ALLGATHER}",
                )
        if fused_set:
            missing = [flag for flag in DSA_FUSED_FLAGS if flag not in fused_set]
            if missing:
                _fail(
                    ", ".join(f"{OTC}.{f}=True" for f in fused_set),
                    "the three fused DSA operators only work together",
                    "also set " + ", ".join(f"{OTC}.{f}=True" for f in missing) + " (or none of them)",
                )
            heads = tf.get("dsa_indexer_n_heads")
            if heads not in FUSED_KL_LOSS_HEADS:
                _fail(
                    f"{OTC}.use_fused_lightning_indexer_kl_loss=True with dsa_indexer_n_heads={heads}",
                    f"the fused indexer KL loss supports {', '.join(map(str, FUSED_KL_LOSS_HEADS))} indexer heads",
                    "drop the three fused DSA flags (the portable path has no head limit)",
                )
            if platform == "ascend":
                features.append("dsa_fused_ascend")
            else:
                notes.append(f"{', '.join(DSA_FUSED_FLAGS)} are Ascend operators; {platform} uses the portable path")
    elif fused_set:
        _fail(
            ", ".join(f"{OTC}.{f}=True" for f in fused_set),
            "fused DSA operators need a DSA model",
            f"set {OTC}.experimental_attention_variant=dsa on an MLA model, or drop the flags",
        )

    # --- offload and the precision-aware optimizer ----------------------------------------------
    if _get(engine_config, "param_offload", False):
        features.append("param_offload")
    if _get(engine_config, "optimizer_offload", False):
        features.append("optimizer_offload")
    precision_aware = bool(_get(optimizer_config, "use_precision_aware_optimizer", False))
    raw = {key: str(_get(optimizer_config, key, "fp32")) for key in PRECISIONS}
    dtypes = {key: _DTYPE_ALIASES.get(value, value) for key, value in raw.items()}
    for key, value in dtypes.items():
        if value not in PRECISIONS[key]:
            _fail(
                f"optim.{key}={value}",
                f"{key} must be one of {', '.join(PRECISIONS[key])}",
                f"set optim.{key} to one of {', '.join(PRECISIONS[key])}",
            )
    if precision_aware:
        if not _get(engine_config, "use_distributed_optimizer", True):
            _fail(
                "optim.use_precision_aware_optimizer=True with megatron.use_distributed_optimizer=False",
                "megatron's precision-aware optimizer requires the distributed optimizer",
                "set megatron.use_distributed_optimizer=True",
            )
        if platform != "ascend" and importlib.util.find_spec("transformer_engine") is None:
            _fail(
                "optim.use_precision_aware_optimizer=True",
                f"off Ascend it needs TransformerEngine's FusedAdam, which is not installed on this {platform} machine",
                "install transformer_engine, or set optim.use_precision_aware_optimizer=False",
            )
        features.append("precision_aware_optimizer")
        if "grad_reduce_in_fp32" not in user_ddp:
            ddp["grad_reduce_in_fp32"] = dtypes["main_grads_dtype"] == "fp32"
            notes.append(f"DDP gradient buckets follow main_grads_dtype={dtypes['main_grads_dtype']}")
    else:
        lowered = [f"optim.{k}={v}" for k, v in dtypes.items() if v != "fp32"]
        if lowered:
            _fail(
                ", ".join(lowered),
                "lower-precision optimizer dtypes only take effect with the precision-aware optimizer",
                "set optim.use_precision_aware_optimizer=True, or keep them at fp32",
            )

    if platform == "ascend":
        cp = int(_get(engine_config, "context_parallel_size", 1) or 1)
        if cp > 1:
            repatch["context_parallel_size"] = cp
        repatch.setdefault("use_flash_attn", True)
    return BuildPlan(
        platform=platform,
        features=tuple(features),
        transformer_overrides=tf,
        ddp_overrides=ddp,
        mindspeed_repatch=repatch if platform == "ascend" else None,
        rmsnorm_impl=rmsnorm_impl,
        notes=tuple(notes),
    )
