"""The DSA indexer's top-k without dense index scores on the no-grad path (log-probs, evaluation).

Changes: wraps megatron-core's ``DSAIndexer.forward_with_scores``. For DSAttention's causal mask
(a 2-D ``[sq, skv]`` float mask) or no mask, it runs the indexer's own projections
(``forward_before_topk``) and picks the top-k with ``verl_npu.ops.dispatch.dsa_indexer_topk``
(query chunks, O(chunk * s) memory), and returns ``None`` in place of the ``[b, s, s]`` index
scores. A padding mask (3-D), or a call with gradients enabled, runs megatron's code unchanged.
Why: RL computes old and reference log-probs without gradients, and there DSAttention takes its
no-grad branch, ``self.indexer.forward_with_scores``, whose ``fused_qk_topk_naive`` builds
``[s, b, index_heads, s]`` fp32 scores: 128 GiB per layer at 32k tokens with GLM-5's 32 indexer
heads, so long-context log-probs cannot run. Every caller in megatron-core 0.18.0 discards the
scores (``DSAIndexer.forward`` and ``DSAttention.forward``'s no-grad branch, dsa.py lines 916 and
1110); the pinned source hash of the wrapped method catches a change of it, and a caller that
needs the scores can compute them with megatron's ``fused_qk_topk_naive``.
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py
(DSAIndexer.forward_with_scores, fused_qk_topk_naive).
Remove when: megatron-core selects the indexer's top-k without materialising the index scores.
"""

from __future__ import annotations

import functools

import torch

from verl_npu.patching import Patch

DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"


def _build(original):
    @functools.wraps(original)
    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        if torch.is_grad_enabled() or (mask is not None and mask.dim() != 2):
            return original(self, x, qr, mask, packed_seq_params)
        if packed_seq_params is not None:
            # megatron refuses packed sequences here too; keep its message
            return original(self, x, qr, mask, packed_seq_params)
        from verl_npu.ops import dispatch

        q, k, weights = self.forward_before_topk(x, qr, packed_seq_params)
        # DSAttention's 2-D mask is its causal mask (-inf above the diagonal)
        topk_indices = dispatch.dsa_indexer_topk(q, k, weights, self.index_topk, causal=mask is not None)
        return None, topk_indices

    return forward_with_scores


PATCH = Patch(
    id="dsa-indexer-topk-eval",
    target=f"{DSA_MODULE}:DSAIndexer.forward_with_scores",
    kind="wrap",
    platforms=frozenset({"ascend", "cuda", "cpu"}),
    requires={"megatron-core": "==0.18.0"},
    source_sha256="4e3db2c100ae76a29e3e2abd49faf86c159226e1fc781b166b630cb601de564d",
    reason="without gradients (log-probs) megatron's DSA indexer builds [s, b, index_heads, s] fp32 scores only to "
    "take their top-k and discard them; top-k chosen in query chunks instead",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::DSAIndexer.forward_with_scores",
    remove_when="megatron-core selects the DSA indexer's top-k without materialising the index scores",
    build=_build,
)
