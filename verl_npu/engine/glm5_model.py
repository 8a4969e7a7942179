"""Build a GLM-5-shaped megatron-core model (MLA + DSA + MoE) from a transformers GlmMoeDsaConfig.

Uses only megatron-core's local modules (verl_npu.engine.layer_spec), so it builds on Ascend, CUDA
without TransformerEngine and CPU, with DSA attention and, with ``fused_rmsnorm``, verl_npu's
RMSNorm. Weights are not loaded (random init): this is the engine's test model.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_npu.engine.glm5_config import moe_layer_freq
from verl_npu.engine.layer_spec import local_decoder_block_spec


def transformer_config_from_hf(hf_config: Any, **overrides: Any):
    """MLATransformerConfig with the shape of a GlmMoeDsaConfig (plus ``overrides``)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    layers = hf_config.num_hidden_layers
    fields = dict(
        num_layers=layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rope_type="rope",
        rotary_base=getattr(hf_config, "rope_theta", 10000.0) or 10000.0,
        apply_rope_fusion=False,
        qk_layernorm=True,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf_config.index_n_heads,
        dsa_indexer_head_dim=hf_config.index_head_dim,
        dsa_indexer_topk=hf_config.index_topk,
        dsa_indexer_loss_coeff=0.0,
        num_moe_experts=hf_config.n_routed_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0) or None,
        moe_layer_freq=moe_layer_freq(hf_config),  # the bridge's reading: mlp_layer_types, as transformers builds
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def build_glm5_model(
    hf_config: Any,
    *,
    fused_rmsnorm: bool,
    vocab_size: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    **overrides: Any,
):
    """A megatron GPTModel with GLM-5's layer structure, on the local spec (one pipeline stage's part
    of it with ``pre_process`` / ``post_process``, as megatron's model providers build them)."""
    from megatron.core.models.gpt import GPTModel

    from verl_npu.engine.index_share import apply_to_glm5_block

    config = transformer_config_from_hf(hf_config, **overrides)
    block = apply_to_glm5_block(local_decoder_block_spec(config, fused_rmsnorm=fused_rmsnorm), hf_config, config)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab_size or hf_config.vocab_size,
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        position_embedding_type="none",
        pre_process=pre_process,
        post_process=post_process,
    )
