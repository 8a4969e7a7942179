"""The DSA indexer's top-k without dense index scores where megatron discards them (log-probs, evaluation).

Changes: wraps megatron-core's ``DSAIndexer.forward_with_scores``. Called from DSAttention.forward
(its no-grad branch; see dsa-call-context) or from ``DSAIndexer.forward`` (also wrapped), whose
callers never see the scores, it runs the indexer's own projections (``forward_before_topk``), picks
the top-k with ``verl_npu.ops.dispatch.dsa_indexer_topk`` (query chunks, O(chunk * s) memory) under
DSAttention's causal mask or without a mask, and returns ``None`` in place of the ``[b, s, s]``
index scores. Any other mask, or a call from anywhere else (a caller that wants the scores), runs
megatron's code unchanged.
Why: RL computes old and reference log-probs without gradients, and there DSAttention takes its
no-grad branch, ``_, topk_indices = self.indexer.forward_with_scores(...)``, whose
``fused_qk_topk_naive`` builds ``[s, b, index_heads, s]`` fp32 scores only to take their top-k:
128 GiB per layer at 32k tokens with GLM-5's 32 indexer heads, so long-context log-probs cannot run.
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py
(DSAttention.forward, DSAIndexer.forward, DSAIndexer.forward_with_scores, fused_qk_topk_naive).
Remove when: megatron-core selects the indexer's top-k without materialising the index scores.
"""

from __future__ import annotations

import contextvars
import functools

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE
from verl_npu.runtime_patches.dsa_call_context import causal_dsa_mask, inside_dsa_attention

# set while DSAIndexer.forward, which discards forward_with_scores' scores, is running
_SCORES_DISCARDED = contextvars.ContextVar("verl_npu_dsa_index_scores_discarded", default=False)


def _discarding_caller(original):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        token = _SCORES_DISCARDED.set(True)
        try:
            return original(*args, **kwargs)
        finally:
            _SCORES_DISCARDED.reset(token)

    return forward


def _forward_with_scores(original):
    @functools.wraps(original)
    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        discarded = _SCORES_DISCARDED.get() or inside_dsa_attention()  # DSAttention only takes the top-k
        known_mask = mask is None or (mask.dim() == 2 and causal_dsa_mask())
        # packed sequences: megatron refuses them here; keep its message
        if not (discarded and known_mask) or packed_seq_params is not None:
            return original(self, x, qr, mask, packed_seq_params)
        from verl_npu.ops import dispatch

        q, k, weights = self.forward_before_topk(x, qr, packed_seq_params)
        topk_indices = dispatch.dsa_indexer_topk(q, k, weights, self.index_topk, causal=mask is not None)
        return None, topk_indices

    return forward_with_scores


COMMON = dict(
    kind="wrap",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    reason="without gradients (log-probs) megatron's DSA indexer builds [s, b, index_heads, s] fp32 scores only to "
    "take their top-k and discard them; top-k chosen in query chunks instead",
    remove_when="megatron-core selects the DSA indexer's top-k without materialising the index scores",
)
FORWARD_WITH_SCORES = Patch(
    id="dsa-indexer-topk-eval",
    target=f"{DSA_MODULE}:DSAIndexer.forward_with_scores",
    source_sha256="4e3db2c100ae76a29e3e2abd49faf86c159226e1fc781b166b630cb601de564d",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::DSAIndexer.forward_with_scores",
    build=_forward_with_scores,
    **COMMON,
)
INDEXER_CALLER = Patch(
    id="dsa-indexer-topk-eval-indexer",
    target=f"{DSA_MODULE}:DSAIndexer.forward",
    source_sha256="c76286db36dff1a71e66d7b690eef9afd1d10bd427fad204d8f4dc76e6f055a9",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::DSAIndexer.forward "
    "(returns the top-k only)",
    build=_discarding_caller,
    **COMMON,
)
PATCHES = (FORWARD_WITH_SCORES, INDEXER_CALLER)
