"""GLM-5's HF config -> megatron-core TransformerConfig fields, GLM-5.2's indexer layout, and what the bridge refuses.

Pure Python (no torch, mbridge or megatron imports): the bridge (verl_npu.engine.bridges.glm5)
builds its model with these fields, and ``verl-npu preflight`` runs the same function on a launch's
model config to report a model the bridge cannot build before the job queues.
"""

from __future__ import annotations

from typing import Any

from verl_npu.models.family import FULL, SHARED

MODEL_TYPE = "glm_moe_dsa"


def rope_parameters(hf_config: Any) -> tuple[str, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("GLM-5 bridge: the HF config gives no rope_theta (rope_parameters['rope_theta'])")
    return rope_type, float(theta)


def moe_layer_freq(hf_config: Any) -> list[int]:
    layers = hf_config.num_hidden_layers
    # transformers builds GLM-5's MLPs from mlp_layer_types (first_k_dense_replace is not read there),
    # so that list decides which checkpoint layers have experts.
    kinds = getattr(hf_config, "mlp_layer_types", None)
    if kinds is not None:
        if len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
            raise ValueError(f"GLM-5 bridge: mlp_layer_types must list 'dense'/'sparse' per layer, got {kinds}")
        return [int(kind == "sparse") for kind in kinds]
    dense = min(getattr(hf_config, "first_k_dense_replace", 0) or 0, layers)
    return [0] * dense + [1] * (layers - dense)


def _router_fields(hf_config: Any) -> dict[str, Any]:
    """GLM-5's router: sigmoid scores, a score-correction bias for the choice only, top-k weights
    normalised and scaled by routed_scaling_factor, optionally limited to the best expert groups."""
    topk = hf_config.num_experts_per_tok
    if topk > 1 and not getattr(hf_config, "norm_topk_prob", True):
        raise NotImplementedError(
            "GLM-5 bridge: norm_topk_prob=False; megatron's sigmoid router always normalises the top-k weights"
        )
    fields: dict[str, Any] = dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # holds e_score_correction_bias
        # RL starts from the checkpoint's routing bias and keeps it (as mbridge's GLM-4.5 bridge does).
        moe_router_bias_update_rate=0.0,
        moe_router_topk=topk,
        moe_router_topk_scaling_factor=hf_config.routed_scaling_factor,
        moe_router_dtype="fp32",  # the HF router computes its logits in fp32
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    groups, group_topk = getattr(hf_config, "n_group", 1) or 1, getattr(hf_config, "topk_group", 1) or 1
    if groups > 1:
        # megatron scores a group by the sum of its top (topk // group_topk) experts, HF by its top 2.
        if topk // group_topk != 2:
            raise NotImplementedError(
                f"GLM-5 bridge: n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk}: megatron scores "
                "expert groups by their top num_experts_per_tok // topk_group experts, the HF model by its top 2"
            )
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return fields


def glm5_2_indexer_types(num_layers: int) -> list[str]:
    """GLM-5.2's published IndexShare layout (``indexer_types`` of examples/glm5_2/config.json, 78 layers: 21 full,
    57 shared): a full indexer in layers 0-2 and in every fourth layer from 2 on, shared in the others. Test models
    cut it to fewer layers."""
    return [FULL if i < 3 or (i - 2) % 4 == 0 else SHARED for i in range(num_layers)]


def indexer_types(hf_config: Any) -> tuple[str, ...]:
    """Each layer's DSA indexer: "full" computes its top-k, "shared" reuses the most recent full layer's.

    GLM-5.2 lists them per layer (``indexer_types``; IndexShare, arXiv 2603.12201): shared layers ship
    no indexer weights. A config without the list (GLM-5) has a full indexer in every layer.
    """
    layers = hf_config.num_hidden_layers
    kinds = getattr(hf_config, "indexer_types", None)
    if kinds is None:
        return (FULL,) * layers
    kinds = tuple(kinds)
    if len(kinds) != layers or set(kinds) - {FULL, SHARED}:
        raise ValueError(
            f"GLM-5 bridge: indexer_types must list 'full' or 'shared' for each of the {layers} layers, "
            f"got {list(kinds)}"
        )
    if kinds and kinds[0] == SHARED:
        raise ValueError(
            "GLM-5 bridge: indexer_types[0] is 'shared', but the first layer has no earlier layer's top-k to reuse "
            "(and a shared layer ships no indexer weights)"
        )
    return kinds


def glm5_config_fields(hf_config: Any, platform: str = "cuda") -> dict[str, Any]:
    """TransformerConfig fields for a GlmMoeDsaConfig, beyond mbridge's common LLM mapping, on ``platform``.

    The per-layer indexer kinds (:func:`indexer_types`) are not a TransformerConfig field: the layer
    specs carry them (verl_npu.engine.index_share). On Ascend the experts are not grouped: MindSpeed core_r0.18.0
    refuses ``moe_grouped_gemm`` when the config is built (contract mindspeed-refuses-moe-grouped-gemm).
    """
    indexer_types(hf_config)  # validated here so that a config the engine cannot build fails early
    rope_type, theta = rope_parameters(hf_config)
    if rope_type != "default":
        raise NotImplementedError(f"GLM-5 bridge: rope_type {rope_type!r}; only 'default' RoPE is mapped")
    if hf_config.q_lora_rank is None:
        raise NotImplementedError("GLM-5 bridge: DSA's indexer reads the q low-rank input; q_lora_rank is None")
    if getattr(hf_config, "attention_bias", False):
        raise NotImplementedError("GLM-5 bridge: attention_bias=True is not mapped (GLM-5 has no attention biases)")
    shared = hf_config.moe_intermediate_size * (getattr(hf_config, "n_shared_experts", 0) or 0)
    return dict(
        # MLA
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        qk_layernorm=True,  # the q_a / kv_a RMSNorms
        rope_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        apply_rope_fusion=False,  # megatron's DSA asserts it
        # DSA
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf_config.index_n_heads,
        dsa_indexer_head_dim=hf_config.index_head_dim,
        dsa_indexer_topk=hf_config.index_topk,
        # No indexer KL loss: RL keeps the checkpoint's indexer (its inputs are detached from the model).
        dsa_indexer_loss_coeff=0.0,
        # MoE
        num_moe_experts=hf_config.n_routed_experts,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared or None,
        moe_layer_freq=moe_layer_freq(hf_config),
        # TE's grouped experts off Ascend (the local spec builds SequentialMLP either way); MindSpeed refuses them
        moe_grouped_gemm=platform != "ascend",
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_overlap=False,  # needs CUDA streams; an engine override can turn it on
        **_router_fields(hf_config),
        add_bias_linear=False,
        # DeepSeek-V3's bridge also turns on persist_layer_norm (an apex/TE kernel the local spec's norms
        # refuse) and the bias/activation/dropout fusions (torch.compile): performance switches that an
        # engine's override_transformer_config can set where they work.
    )
