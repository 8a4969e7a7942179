"""The local-spec modules megatron-core 0.18 lacks: THD-capable core attention, SP-capable LayerNorm."""

from __future__ import annotations

import pytest
import torch

import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches: DSA on the local spec)

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")


@pytest.fixture(autouse=True)
def rng_tracker():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1)  # megatron's attention draws dropout from this tracker


def attention_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
    )  # fmt: skip
    fields.update(overrides)
    return TransformerConfig(**fields)


def packed(lengths_padded: list[int], lengths: list[int] | None = None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_padded = torch.tensor([0, *torch.tensor(lengths_padded).cumsum(0).tolist()], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(lengths or lengths_padded).cumsum(0).tolist()], dtype=torch.int32)
    top = max(lengths_padded)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=top, max_seqlen_kv=top,
    )  # fmt: skip


def attention(config, cls=None):
    from megatron.core.transformer.enums import AttnMaskType

    from verl_npu.engine.packed_attention import PackedDotProductAttention

    return (cls or PackedDotProductAttention)(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )


def test_thd_attention_equals_megatrons_attention_on_each_sequence_alone():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    torch.manual_seed(0)
    config = attention_config()
    ours, megatrons = attention(config), attention(config, DotProductAttention)
    lengths = [5, 11, 1, 8]  # odd lengths; 2 heads per key/value group (GQA)
    total = sum(lengths)
    query = torch.randn(total, 4, 16, requires_grad=True)
    key = torch.randn(total, 2, 16, requires_grad=True)
    value = torch.randn(total, 2, 16, requires_grad=True)
    out = ours(query, key, value, None, packed_seq_params=packed(lengths))
    assert out.shape == (total, 64)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        # megatron's local attention on this sequence alone, [s, b=1, heads, d], causal mask
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
        alone = megatrons(query[part, None], key[part, None], value[part, None], causal)
        torch.testing.assert_close(out[part], alone[:, 0], rtol=1e-5, atol=1e-5)
        start += length
    out.sum().backward()
    assert query.grad is not None and key.grad.abs().sum() > 0


def test_thd_padding_between_sequences_does_not_reach_the_valid_tokens():
    torch.manual_seed(1)
    ours = attention(attention_config())
    q, k, v = torch.randn(12, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    out = ours(q, k, v, None, packed_seq_params=packed([6, 6], [5, 4]))
    changed = [t.clone() for t in (q, k, v)]
    for t in changed:  # overwrite the padding slots (index 5, and 10-11)
        t[5] = 100.0
        t[10:] = -100.0
    out2 = ours(*changed, None, packed_seq_params=packed([6, 6], [5, 4]))
    valid = [0, 1, 2, 3, 4, 6, 7, 8, 9]
    torch.testing.assert_close(out[valid], out2[valid])


def test_bshd_input_is_megatrons_own_attention_exactly():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    torch.manual_seed(2)
    config = attention_config()
    q, k, v = torch.randn(7, 2, 4, 16), torch.randn(7, 2, 2, 16), torch.randn(7, 2, 2, 16)
    causal = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)
    assert torch.equal(attention(config)(q, k, v, causal), attention(config, DotProductAttention)(q, k, v, causal))


@pytest.mark.parametrize(
    ("overrides", "call", "message"),
    [
        ({}, {"qkv_format": "sbhd"}, "qkv_format='sbhd'"),
        ({"apply_query_key_layer_scaling": True, "fp16": True}, {}, "apply_query_key_layer_scaling"),
        ({}, {"attention_bias": True}, "attention_bias"),
    ],
)
def test_thd_refuses_what_it_does_not_implement(overrides, call, message):
    ours = attention(attention_config(**overrides))
    params = packed([4])
    if "qkv_format" in call:
        params.qkv_format = call["qkv_format"]
    bias = torch.zeros(1) if call.get("attention_bias") else None
    q = torch.randn(4, 4, 16)
    with pytest.raises(ValueError, match=message):
        ours(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), None, attention_bias=bias, packed_seq_params=params)


def test_layernorm_marks_its_parameters_for_the_sequence_parallel_all_reduce():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from verl_npu.engine.modules import LayerNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=2, sequence_parallel=True,
    )  # fmt: skip
    norm = LayerNorm(config=config, hidden_size=32, eps=1e-6)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert set(norm.state_dict()) == {"weight", "bias"}  # torch LayerNorm's names: checkpoints stay compatible
    x = torch.randn(3, 32)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (32,), eps=1e-6))


def test_local_spec_uses_both_modules_for_glm5_shapes():
    from transformers import GlmMoeDsaConfig

    from verl_npu.engine.layer_spec import local_decoder_block_spec
    from verl_npu.engine.modules import LayerNorm, RMSNorm
    from verl_npu.engine.packed_attention import PackedDotProductAttention
    from verl_npu.testing.glm5_model import transformer_config_from_hf

    hf = GlmMoeDsaConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=4,
    )  # fmt: skip
    dsa = local_decoder_block_spec(transformer_config_from_hf(hf, use_cpu_initialization=True), fused_rmsnorm=True)
    indexer = dsa.layer_specs[0].submodules.self_attention.submodules.core_attention.submodules.indexer
    assert indexer.submodules.k_norm is LayerNorm
    assert dsa.layer_specs[0].submodules.input_layernorm is RMSNorm
    mla = local_decoder_block_spec(
        transformer_config_from_hf(hf, use_cpu_initialization=True, experimental_attention_variant=None),
        fused_rmsnorm=False,
    )
    assert mla.layer_specs[1].submodules.self_attention.submodules.core_attention is PackedDotProductAttention
