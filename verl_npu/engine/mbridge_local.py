"""Let a verl mbridge bridge build its model on the local spec (verl_npu.engine.layer_spec).

mbridge 0.15.1's ``LLMBridge._get_transformer_layer_spec`` always asks megatron for the
TransformerEngine spec, and its HF weight-name tables use TE's parameter names, where the input norm
is fused into the QKV projection (``self_attention.linear_qkv.layer_norm_weight``). On the local
spec the same weights are separate norms (``input_layernorm.weight``), so loading HF weights would
fail with "Unsupported parameter name". :func:`build_on_local_spec` changes one bridge instance (the
engine's), not the mbridge classes: its layer spec comes from ``local_decoder_block_spec`` and local
norm names fall back to their TE names for the HF name lookup; tensor layouts are identical.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from verl_npu.engine.layer_spec import local_decoder_block_spec

# local-spec parameter suffix -> the TE-spec suffix mbridge's tables know for the same weight
LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
    (".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight"),
    (".self_attention.kv_layernorm.weight", ".self_attention.linear_kv_up_proj.layer_norm_weight"),
)


def te_name(local_name: str) -> str | None:
    for local, te in LOCAL_TO_TE_NAMES:
        if local_name.endswith(local):
            return local_name[: -len(local)] + te
    return None


def build_on_local_spec(bridge: Any, *, fused_rmsnorm: bool) -> None:
    """Point ``bridge`` (a verl/mbridge LLMBridge instance) at the local spec; idempotent."""
    if getattr(bridge, "_verl_npu_local_spec", None) is not None:
        bridge._verl_npu_local_spec = fused_rmsnorm
        return
    to_hf = bridge._weight_name_mapping_mcore_to_hf

    def layer_spec(vp_stage: int | None = None):
        bridge.has_vp_stage = True  # read by LLMBridge's model provider (set by the method we replace)
        block = local_decoder_block_spec(bridge.config, fused_rmsnorm=bridge._verl_npu_local_spec, vp_stage=vp_stage)
        transform = getattr(bridge, "transform_block_spec", None)  # a bridge's own layer changes (GLM-5: IndexShare)
        return transform(block, vp_stage) if transform is not None else block

    def name_to_hf(mcore_name: str) -> list[str]:
        try:
            return to_hf(mcore_name)
        except NotImplementedError:
            fallback = te_name(mcore_name)
            if fallback is None:
                raise
            return to_hf(fallback)

    bridge._verl_npu_local_spec = fused_rmsnorm
    if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
        # megatron's local attention would import this apex-built CUDA extension for the fused
        # softmax and fail instead of falling back; without it, use the PyTorch softmax.
        bridge.config.masked_softmax_fusion = False
    bridge._get_transformer_layer_spec = layer_spec
    bridge._weight_name_mapping_mcore_to_hf = name_to_hf


def drop_right_padding_mask(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """GPTModel forward pre-hook: a right-padding mask [batch, seq] becomes no mask (causal only).

    verl's BSHD path (``use_remove_padding=False``) moves every sequence's tokens to the front and
    passes the [batch, seq] padding mask, which TE's attention takes and megatron's local
    ``DotProductAttention`` cannot (it wants a [batch, 1, seq, seq] mask). Under causal attention a
    valid token never attends to the padding after it, so the causal mask alone gives the valid
    tokens identical outputs (verl discards the padded positions). Any other mask is refused.
    """
    import torch

    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return None
    lengths = mask.sum(dim=-1, keepdim=True)
    right_padded = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) < lengths
    if not torch.equal(mask.bool(), right_padded):
        raise ValueError(
            "verl-npu local-spec model: the [batch, seq] attention mask is not right-padding only; megatron's local "
            "attention cannot apply it. Use use_remove_padding=False with verl's BSHD preprocessing."
        )
    return args, {**kwargs, "attention_mask": None}


def install_mask_adapter(model_chunks: list[Any]) -> None:
    """Register :func:`drop_right_padding_mask` on the GPTModel inside each (DDP/Float16) chunk."""
    for chunk in model_chunks:
        inner = chunk
        while hasattr(inner, "module"):
            inner = inner.module
        if not getattr(inner, "_verl_npu_mask_adapter", False):
            inner.register_forward_pre_hook(drop_right_padding_mask, with_kwargs=True)
            inner._verl_npu_mask_adapter = True
