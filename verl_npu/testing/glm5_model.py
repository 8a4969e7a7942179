"""Build a GLM-5-shaped megatron-core model (MLA + DSA + MoE) from a transformers GlmMoeDsaConfig.

Uses only megatron-core's local modules (verl_npu.engine.layer_spec), so it builds on Ascend, CUDA
without TransformerEngine and CPU, with DSA attention and, with ``fused_rmsnorm``, verl_npu's
RMSNorm. Weights are not loaded (random init): this is the engine's test model.

Its TransformerConfig is the bridge's (verl_npu.models.glm5.config.glm5_config_fields on top of the
model-shape fields mbridge's LLMBridge maps) with the differences below as named overrides, and
nothing else (tests_npu/testing/test_glm5_model.py compares it with GLM5Bridge's config field by field).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_npu.engine.layer_spec import local_decoder_block_spec
from verl_npu.models.glm5.config import glm5_config_fields

# Tokens reach the experts by all-gather: the test model runs in one process or on a few gloo ranks,
# where the bridge's all-to-all dispatcher buys nothing.
ALLGATHER_DISPATCHER: dict[str, Any] = dict(moe_token_dispatcher_type="allgather")
# megatron's default softmax router, without GLM-5's sigmoid scores, score-correction bias, top-k scaling
# and fp32 router: the model is randomly initialised (there is no checkpoint bias to load), and the tests'
# reference values were recorded with this router.
SOFTMAX_ROUTER: dict[str, Any] = dict(
    moe_router_score_function="softmax",
    moe_router_enable_expert_bias=False,
    moe_router_topk_scaling_factor=None,
    moe_router_dtype=None,
)
# SequentialMLP experts as the local spec builds them, not the bridge's request for TE's grouped GEMM.
SEQUENTIAL_EXPERTS: dict[str, Any] = dict(moe_grouped_gemm=False)
# Every field in which the test model departs from the bridge's mapping.
TEST_MODEL_OVERRIDES: dict[str, Any] = {**ALLGATHER_DISPATCHER, **SOFTMAX_ROUTER, **SEQUENTIAL_EXPERTS}


def _shape_fields(hf_config: Any) -> dict[str, Any]:
    """The fields mbridge's LLMBridge maps from any LLM config (its _CONFIG_MAPPING and base config)."""
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        layernorm_epsilon=hf_config.rms_norm_eps,
        attention_dropout=hf_config.attention_dropout,
        hidden_dropout=getattr(hf_config, "hidden_dropout", 0.0),
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )


def transformer_config_from_hf(hf_config: Any, **overrides: Any):
    """The test model's MLATransformerConfig: the bridge's mapping, TEST_MODEL_OVERRIDES, then ``overrides``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = _shape_fields(hf_config) | glm5_config_fields(hf_config) | TEST_MODEL_OVERRIDES | overrides
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
