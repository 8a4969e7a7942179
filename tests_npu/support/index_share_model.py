"""The tiny GLM-5.2-shaped model of the IndexShare tests (tests_npu/engine/test_index_share.py and its parallel ranks,
support/index_share_parallel.py): layers 0, 1, 2 and 6 full, 3, 4, 5 and 7 shared (GLM-5.2's layout cut to 8
layers), an index top-k (6) below the sequence length (24 tokens), so that the selection matters."""

from __future__ import annotations

from transformers import GlmMoeDsaConfig

from verl_npu.models.glm5.config import glm5_2_indexer_types

KINDS = glm5_2_indexer_types(8)
HF = GlmMoeDsaConfig(
    vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=128,
    moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    mlp_layer_types=["dense", "sparse", "dense", "sparse", "dense", "sparse", "dense", "sparse"],
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=6, max_position_embeddings=64, indexer_types=KINDS,
)  # fmt: skip
SEQ = 24
