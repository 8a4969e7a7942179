"""DSA indexer scoring and top-k selection in query chunks: O(chunk * s) memory instead of O(s^2 * heads).

megatron-core 0.18's ``fused_qk_topk_naive`` materialises ``[s, b, index_heads, s]`` fp32 scores
(137 GB at 32k with GLM-5's 32 indexer heads) before reducing over the heads. The score of key t for
query s is ``sum_h relu(q[s, h] . k[t]) * w[s, h]`` (``_compute_index_scores``, fp32), plus the
additive mask; top-k over keys. Here each chunk of queries is scored, masked causally and reduced
to its top-k before the next, so only ``[b, chunk, index_heads, s]`` is ever live. Selection only:
no gradient flows through top-k indices (megatron's indexer trains through its separate KL loss).
"""

from __future__ import annotations

import torch

from verl_npu.ops.chunking import DSA_INDEXER_CHUNK_ELEMENTS


def indexer_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    causal: bool = True,
    chunk_budget_elements: int = DSA_INDEXER_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Top-k key indices [b, sq, min(topk, skv)] for q [sq, b, h, d], k [skv, b, d], weights [sq, b, h]."""
    sq, b, heads, dim = q.shape
    skv = k.shape[0]
    if k.shape[1:] != (b, dim) or weights.shape != (sq, b, heads):
        raise ValueError(f"k {tuple(k.shape)} / weights {tuple(weights.shape)} do not match q {tuple(q.shape)}")
    keep = min(topk, skv)
    chunk = max(1, min(sq, chunk_budget_elements // max(b * heads * skv, 1)))
    out = torch.empty(b, sq, keep, dtype=torch.long, device=q.device)
    keys = k.float().permute(1, 2, 0)  # [b, d, skv]
    with torch.no_grad():
        for start in range(0, sq, chunk):
            stop = min(start + chunk, sq)
            queries = q[start:stop].float().permute(1, 0, 2, 3).reshape(b, (stop - start) * heads, dim)
            scores = torch.bmm(queries, keys).view(b, stop - start, heads, skv).relu_()
            scores = (scores * weights[start:stop].float().permute(1, 0, 2).unsqueeze(-1)).sum(2)  # [b, rows, skv]
            if causal:
                rows = torch.arange(start, stop, device=q.device).unsqueeze(1)
                scores.masked_fill_(torch.arange(skv, device=q.device).unsqueeze(0) > rows, float("-inf"))
            out[:, start:stop] = scores.topk(keep, dim=-1).indices
    return out
