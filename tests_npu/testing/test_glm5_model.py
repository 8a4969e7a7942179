"""The GLM-5-shaped test model builds on megatron-core's local spec and trains on CPU (harness)."""

from __future__ import annotations

import torch
from transformers import GlmMoeDsaConfig

import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches: DSA on the local spec, Hadamard, CPU init)
from verl_npu.engine.modules import RMSNorm
from verl_npu.testing.glm5_model import build_glm5_model, transformer_config_from_hf

HF = GlmMoeDsaConfig(
    vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
    moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    mlp_layer_types=["dense", "sparse"],
    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    index_n_heads=4, index_head_dim=32, index_topk=8, max_position_embeddings=64,
)  # fmt: skip


def test_config_mapping_follows_the_hf_config():
    config = transformer_config_from_hf(GlmMoeDsaConfig())  # GLM-5 defaults
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (78, 6144, 64)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (256, 8, 2048)
    assert (config.kv_lora_rank, config.q_lora_rank, config.v_head_dim) == (512, 2048, 256)
    assert (config.dsa_indexer_topk, config.dsa_indexer_n_heads, config.dsa_indexer_head_dim) == (2048, 32, 128)
    assert config.experimental_attention_variant == "dsa" and config.qk_layernorm


def test_tiny_glm5_builds_with_fused_rmsnorm_and_trains_on_cpu(cpu_megatron_harness):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.moe_layer import MoELayer

    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = build_glm5_model(
        HF, fused_rmsnorm=True, use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True
    )
    layers = model.decoder.layers
    assert isinstance(layers[0].input_layernorm, RMSNorm) and isinstance(model.decoder.final_layernorm, RMSNorm)
    assert not isinstance(layers[0].mlp, MoELayer) and isinstance(layers[1].mlp, MoELayer)  # mlp_layer_types
    assert all(any(isinstance(m, DSAttention) for m in layer.modules()) for layer in layers)
    wrapped = Float16Module(model.config, model)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = wrapped(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert sum(g is not None and bool(torch.count_nonzero(g)) for g in grads) > len(grads) // 2


def test_no_grad_log_probs_pick_the_indexer_top_k_without_dense_scores(cpu_megatron_harness, monkeypatch):
    """RL's old/ref log-probs run without gradients: DSAttention's no-grad branch, patched to chunked top-k."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.module import Float16Module
    from support.runtime_patching import count_dense_index_scores, without

    from verl_npu import megatron_adaptor
    from verl_npu.patching import APPLIED
    from verl_npu.runtime_patches import dsa_call_context, dsa_indexer_topk_eval

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = build_glm5_model(
        HF, fused_rmsnorm=True, use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True
    )
    wrapped = Float16Module(model.config, model).eval()
    tokens = torch.randint(0, 128, (2, 24))  # 24 tokens, top-k 8: the selection matters
    positions = torch.arange(24).unsqueeze(0).expand(2, -1)
    with without(*dsa_indexer_topk_eval.PATCHES), torch.no_grad():
        dense_logits = wrapped(tokens, positions, None)
    engine = megatron_adaptor.load().engine
    assert all(engine.record(p.id).status == APPLIED for p in dsa_indexer_topk_eval.PATCHES)

    dense_calls = count_dense_index_scores(monkeypatch)
    with torch.no_grad():
        logits = wrapped(tokens, positions, None)
    torch.testing.assert_close(logits, dense_logits)
    assert dense_calls == [], "DSAttention's no-grad branch built the dense [s, b, heads, s] index scores"
    # a direct caller asks for the scores: it gets megatron's, whose top-k the patched path matches
    indexer = next(m for m in model.modules() if isinstance(m, dsa.DSAIndexer))
    x, qr = torch.randn(24, 2, 128, dtype=torch.bfloat16), torch.randn(24, 2, 64, dtype=torch.bfloat16)
    causal = torch.triu(torch.full((24, 24), float("-inf")), diagonal=1)
    with torch.no_grad():
        scores, topk = indexer.forward_with_scores(x, qr, mask=causal)
        with dsa_call_context.dsa_attention_call(causal=True):  # as inside DSAttention's causal forward
            chunked = indexer(x, qr, mask=causal)  # DSAIndexer.forward discards the scores: the chunked path
    assert dense_calls == [1] and scores.shape == (2, 24, 24)
    for b in range(2):  # the same keys by score (ties aside)
        torch.testing.assert_close(scores[b].gather(-1, chunked[b]).sort(-1).values,
                                   scores[b].gather(-1, topk[b]).sort(-1).values)  # fmt: skip


def test_the_test_model_config_is_the_bridges_except_for_its_named_overrides(cpu_megatron_harness):
    import dataclasses

    from verl_npu.engine.bridges.glm5 import GLM5Bridge
    from verl_npu.testing.glm5_model import TEST_MODEL_OVERRIDES

    # what mbridge's base config sets for a training run rather than for the model (dtype, fusions, p2p)
    runtime = {"bf16", "params_dtype", "autocast_dtype", "pipeline_dtype", "variable_seq_lengths",
               "batch_p2p_comm", "masked_softmax_fusion"}  # fmt: skip
    tiny = dict(HF.to_diff_dict(), num_key_value_heads=HF.num_attention_heads)  # MLA: no grouped KV heads
    for hf in (GlmMoeDsaConfig(), GlmMoeDsaConfig(**tiny)):
        bridge, test_model = GLM5Bridge(hf).config, transformer_config_from_hf(hf)
        differ = {
            f.name
            for f in dataclasses.fields(bridge)
            if repr(getattr(bridge, f.name)) != repr(getattr(test_model, f.name))
        }
        assert differ - runtime == set(TEST_MODEL_OVERRIDES)
        assert {k: getattr(test_model, k) for k in TEST_MODEL_OVERRIDES} == TEST_MODEL_OVERRIDES
    assert test_model.moe_token_dispatcher_type == "allgather" and test_model.moe_router_score_function == "softmax"
