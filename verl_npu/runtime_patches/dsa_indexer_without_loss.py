"""Skip the DSA indexer's dense KL-loss computations when the loss coefficient is 0 (RL's setting).

Changes: wraps megatron-core's ``fwd_fused_indexer_loss_naive`` and ``bwd_fused_indexer_loss_naive``.
With ``loss_coeff == 0`` and DSAttention's causal mask, the forward picks the top-k keys with
``verl_npu.ops.dispatch.dsa_indexer_topk`` (query chunks, O(chunk * s) memory) and returns a zero
loss; the backward returns zero gradients, which is the exact gradient of a loss scaled by 0. Any
other call (a coefficient above 0, a padding mask) runs megatron's code unchanged.
Why: in training, megatron-core 0.18's DSAttention always goes through FusedDSAIndexerLoss, whose
forward materialises ``[s, b, index_heads, s]`` index scores and ``[b * heads, s, s]`` attention
scores for the KL loss, and whose backward recomputes both, even when the loss is multiplied by 0.
verl-npu's GLM-5 bridge sets ``dsa_indexer_loss_coeff=0`` (RL keeps the checkpoint's indexer), so
those O(s^2 * heads) buffers (hundreds of GB at 32k) bought nothing.
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py
(fwd_fused_indexer_loss_naive, bwd_fused_indexer_loss_naive, FusedDSAIndexerLoss).
Remove when: megatron-core skips the indexer loss when its coefficient is 0.
"""

from __future__ import annotations

import functools

import torch

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE
from verl_npu.runtime_patches.dsa_call_context import causal_dsa_mask


def _forward(original):
    @functools.wraps(original)
    def fwd_fused_indexer_loss_naive(
        q, weights, k, query, key, topk, softmax_scale, loss_coeff, mask, sparse_loss, pg_collection
    ):
        # the chunked top-k reproduces DSAttention's causal mask (or none); any other mask is left to megatron
        if loss_coeff != 0 or (mask is not None and (mask.dim() != 2 or not causal_dsa_mask())):
            return original(
                q, weights, k, query, key, topk, softmax_scale, loss_coeff, mask, sparse_loss, pg_collection
            )
        from verl_npu.ops import dispatch

        topk_indices = dispatch.dsa_indexer_topk(q, k, weights, topk, causal=mask is not None)
        return topk_indices, torch.zeros((), dtype=torch.float32, device=q.device)

    return fwd_fused_indexer_loss_naive


def _backward(original):
    @functools.wraps(original)
    def bwd_fused_indexer_loss_naive(
        q, weights, k, query, key, topk_indices, softmax_scale, loss_coeff, sparse_loss, grad_loss, pg_collection
    ):
        if loss_coeff != 0:
            return original(
                q, weights, k, query, key, topk_indices, softmax_scale, loss_coeff, sparse_loss, grad_loss,
                pg_collection,
            )  # fmt: skip
        return torch.zeros_like(q), torch.zeros_like(weights), torch.zeros_like(k)

    return bwd_fused_indexer_loss_naive


COMMON = dict(
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    reason="with dsa_indexer_loss_coeff=0 megatron still builds dense index and attention scores for the "
    "indexer's KL loss (O(s^2 * heads)); skipped, top-k chosen in query chunks",
    remove_when="megatron-core skips the DSA indexer loss when its coefficient is 0",
)
FORWARD = Patch(
    id="dsa-indexer-without-loss-forward",
    target=f"{DSA_MODULE}:fwd_fused_indexer_loss_naive",
    source_sha256="7ec685b724a1951e6d0d6c86a4b4c7a40652cf17896ea44205c02e50b0075752",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::fwd_fused_indexer_loss_naive",
    build=_forward,
    **COMMON,
)
BACKWARD = Patch(
    id="dsa-indexer-without-loss-backward",
    target=f"{DSA_MODULE}:bwd_fused_indexer_loss_naive",
    source_sha256="ed02fa1f16f17ccc5d1f6c87210800c1d6f6f120f13cf052cee8abd892c5ce8d",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::bwd_fused_indexer_loss_naive",
    build=_backward,
    **COMMON,
)
PATCHES = (FORWARD, BACKWARD)
