"""Core attention for megatron's local spec that accepts packed (THD) batches.

verl's default Megatron path removes padding and packs a micro-batch into one THD sequence
(``use_remove_padding=True``, ``verl.models.mcore.util.preprocess_packed_seqs``). megatron-core
0.18's local ``DotProductAttention`` asserts ``packed_seq_params is None`` (only TransformerEngine's
attention takes THD), so a local-spec model (CUDA without TE, CPU) could only run verl's padded BSHD
path. This subclass runs BSHD exactly as megatron does and THD as causal attention within each
packed sequence (the ``cu_seqlens_*_padded`` boundaries verl passes), through PyTorch's
``scaled_dot_product_attention``. On Ascend, TransformerEngineNPU's attention takes THD instead.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class PackedDotProductAttention(DotProductAttention):
    """megatron's local attention, plus THD input (causal within each packed sequence)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        self._check_packed_supported(packed_seq_params, attn_mask_type, attention_bias)
        cu_q = packed_seq_params.cu_seqlens_q_padded
        if cu_q is None:
            cu_q = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise ValueError("packed attention: query and key sequence boundaries differ (self-attention only)")
        # THD: query [t, heads, d_qk], key [t, groups, d_qk], value [t, groups, d_v]
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        bounds = cu_q.tolist()
        if bounds[-1] > query.shape[0]:
            raise ValueError(f"packed attention: cu_seqlens end at {bounds[-1]}, the batch has {query.shape[0]} tokens")
        dropout = self.config.attention_dropout if self.training else 0.0
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        for start, end in itertools.pairwise(bounds):
            if end > start:
                q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale
                )
                out[start:end] = o.transpose(0, 1)
        return out.reshape(out.shape[0], -1)

    def _check_packed_supported(self, packed_seq_params, attn_mask_type, attention_bias) -> None:
        unsupported = []
        if packed_seq_params.qkv_format != "thd":
            unsupported.append(f"qkv_format={packed_seq_params.qkv_format!r} (only 'thd')")
        if attention_bias is not None:
            unsupported.append("attention_bias")
        if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            unsupported.append(f"attn_mask_type={attn_mask_type or self.attn_mask_type} (only causal)")
        if self.config.context_parallel_size > 1:
            unsupported.append(f"context_parallel_size={self.config.context_parallel_size} (needs TE's attention)")
        if self.config.apply_query_key_layer_scaling:
            unsupported.append("apply_query_key_layer_scaling")
        if getattr(self.config, "window_size", None) is not None:
            unsupported.append(f"window_size={self.config.window_size}")
        if getattr(self.config, "softmax_type", "vanilla") != "vanilla":
            unsupported.append(f"softmax_type={self.config.softmax_type!r}")
        if unsupported:
            raise ValueError("packed (THD) attention on the local spec does not support: " + ", ".join(unsupported))
