"""Build a GLM-5-shaped megatron-core model (MLA + DSA + MoE) from a transformers GlmMoeDsaConfig.

Uses only megatron-core's local modules, so it builds on Ascend, CUDA without TransformerEngine
and CPU: DSA attention comes from :func:`dsa_attention_spec` (megatron's DSA modules with separate
q/kv norms where the backend has no fused layernorm-linear), and ``use_fused_rmsnorm`` swaps every
RMSNorm for verl_npu's. Weights are not loaded (random init): this is the engine's test model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def transformer_config_from_hf(hf_config: Any, **overrides: Any):
    """MLATransformerConfig with the shape of a GlmMoeDsaConfig (plus ``overrides``)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
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
        moe_layer_freq=[0] * min(dense, layers) + [1] * max(layers - dense, 0),
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


def dsa_attention_spec(config, backend):
    """megatron-core's DSA attention spec; without a fused layernorm-linear, q/kv norms stand alone."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend

    fused = backend.column_parallel_layer_norm_linear() is not None
    if fused or not config.qk_layernorm:
        return get_dsa_module_spec_for_backend(config, backend=backend)
    # Same math as the fused path: norm(x) then the up projection, as two modules.
    spec = get_dsa_module_spec_for_backend(dataclasses.replace(config, qk_layernorm=False), backend=backend)
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
    spec.submodules.q_layernorm = norm
    spec.submodules.kv_layernorm = norm
    return spec


def _swap_norms(spec, replacement) -> None:
    """Replace megatron's local RMSNorm builder everywhere in a module spec tree."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    submodules = getattr(spec, "submodules", None)
    if submodules is None:
        return
    for field in dataclasses.fields(submodules) if dataclasses.is_dataclass(submodules) else []:
        value = getattr(submodules, field.name)
        if field.name == "k_norm":  # the DSA indexer's key norm is a LayerNorm by design
            continue
        if value is WrappedTorchNorm:
            setattr(submodules, field.name, replacement)
        elif hasattr(value, "submodules"):
            _swap_norms(value, replacement)


def build_glm5_model(hf_config: Any, *, fused_rmsnorm: bool, vocab_size: int | None = None, **overrides: Any):
    """A megatron GPTModel with GLM-5's layer structure, on the local spec."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from verl_npu.ops.rmsnorm import RMSNorm

    config = transformer_config_from_hf(hf_config, **overrides)
    backend = LocalSpecProvider()
    layer_specs = []
    for is_moe in config.moe_layer_freq:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if is_moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=True,
            multi_latent_attention=True,
            normalization="RMSNorm",
        )
        spec.submodules.self_attention = dsa_attention_spec(config, backend)
        if fused_rmsnorm:
            _swap_norms(spec, RMSNorm)
        layer_specs.append(spec)
    final_norm = RMSNorm if fused_rmsnorm else backend.layer_norm(rms_norm=True)
    block = TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=final_norm)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab_size or hf_config.vocab_size,
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        position_embedding_type="none",
    )
