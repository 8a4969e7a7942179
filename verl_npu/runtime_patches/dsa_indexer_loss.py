"""The DSA indexer's KL loss in query chunks when it is trained (dsa_indexer_loss_coeff > 0).

Changes: replaces ``megatron.core...dsa.FusedDSAIndexerLoss`` with a subclass whose ``apply``, for a
coefficient above 0 under DSAttention's causal mask, picks the top-k keys with
``verl_npu.ops.dispatch.dsa_indexer_topk`` and computes the loss with
``verl_npu.ops.dispatch.dsa_indexer_loss`` (same value and same gradients to the indexer's q,
weights and k, the ``sparse_loss`` variant included, the attention target all-reduced over the
tensor-parallel group as megatron does). Any other call (coefficient 0, a padding mask) runs
megatron's class unchanged, and so the dsa-indexer-without-loss patches where they apply.
Why: megatron-core 0.18's fused naive indexer loss materialises ``[b, np, s, s]`` attention scores
and ``[s, b, index_heads, s]`` index scores in fp32, in forward and again in backward: 256 GiB and
128 GiB per layer at GLM-5's 32k context (64 heads, 32 index heads), so training the indexer (DSA's
warm-up and sparse stages) cannot run at long context. The chunked loss needs O(chunk * s) memory:
measured on nvidia-h200 with those shapes (top-k 2048, bf16, sparse loss; top-k, loss and
gradients), s=4k: 62.1 ms in 1.06 GiB vs megatron's 91.8 ms in 8.3 GiB; s=32k: 4.6 s in 4.3 GiB,
where megatron's asks for 128 GiB and fails (bench/results/kernels_h200.json).
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py (FusedDSAIndexerLoss,
fwd_fused_indexer_loss_naive, bwd_fused_indexer_loss_naive, compute_dsa_indexer_loss).
Remove when: megatron-core's DSA indexer loss no longer materialises dense [s, s] scores.
"""

from __future__ import annotations

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE
from verl_npu.runtime_patches.dsa_call_context import causal_dsa_mask


def _build(original):
    class FusedDSAIndexerLoss(original):
        """megatron's FusedDSAIndexerLoss; with a positive coefficient and the causal mask, in query chunks."""

        @classmethod
        def apply(cls, q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss, pg_collection):
            # the chunked loss reproduces DSAttention's causal mask; any other mask is left to megatron
            if loss_coeff <= 0 or mask is None or mask.dim() != 2 or not causal_dsa_mask():
                return original.apply(
                    q, weights, k, query, key, softmax_scale, topk, loss_coeff, mask, sparse_loss, pg_collection
                )
            from verl_npu.ops import dispatch

            tp = pg_collection.tp if pg_collection is not None and pg_collection.tp.size() > 1 else None
            topk_indices = dispatch.dsa_indexer_topk(q, k, weights, topk, causal=True)
            loss = dispatch.dsa_indexer_loss(
                q, weights, k, query, key, topk_indices, softmax_scale, loss_coeff, sparse_loss, tp_group=tp
            )
            return topk_indices, loss

    FusedDSAIndexerLoss.__module__ = __name__
    FusedDSAIndexerLoss.__qualname__ = "FusedDSAIndexerLoss"
    return FusedDSAIndexerLoss


PATCH = Patch(
    id="dsa-indexer-loss-chunked",
    target=f"{DSA_MODULE}:FusedDSAIndexerLoss",
    kind="replace",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="d542c6d7c40638e84dd62c76b9a4df98cc6c37fb33ca4872f743877e4ee59515",
    reason="with dsa_indexer_loss_coeff > 0 megatron builds dense fp32 attention and index scores for the "
    "indexer's KL loss in forward and backward (O(s^2 * heads)); computed in query chunks, O(chunk * s)",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::FusedDSAIndexerLoss",
    remove_when="megatron-core's DSA indexer loss no longer materialises dense [s, s] scores",
    build=_build,
)
PATCHES = (PATCH,)
