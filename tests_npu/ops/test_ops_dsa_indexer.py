"""The chunked DSA indexer top-k against megatron-core 0.18's fused_qk_topk_naive."""

from __future__ import annotations

import pytest
import torch

from verl_npu.ops.dsa_indexer import indexer_topk


def selection(indices: torch.Tensor, sq: int) -> list[list[set[int]]]:
    return [[set(indices[bb, i].tolist()) for i in range(sq)] for bb in range(indices.shape[0])]


@pytest.mark.parametrize(("sq", "topk", "budget"), [(33, 8, 2**27), (20, 64, 2**27), (41, 5, 3 * 41 * 4)])
def test_topk_sets_match_megatrons_dense_indexer(sq, topk, budget):
    from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive

    gen = torch.Generator().manual_seed(sq)
    b, heads, dim = 2, 4, 16
    q = torch.randn(sq, b, heads, dim, generator=gen)
    k = torch.randn(sq, b, dim, generator=gen)
    w = torch.rand(sq, b, heads, generator=gen)
    causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    scores, theirs = fused_qk_topk_naive(q, k, w, topk, causal.expand(b, sq, sq).contiguous())
    ours = indexer_topk(q, k, w, topk, chunk_budget_elements=budget)
    assert ours.shape == theirs.shape == (b, sq, min(topk, sq))
    for bb in range(b):
        for i in range(sq):
            valid = min(i + 1, ours.shape[-1])
            mine = sorted(ours[bb, i].tolist(), key=lambda j: -scores[bb, i, j].item())[:valid]
            ref = sorted(theirs[bb, i].tolist(), key=lambda j: -scores[bb, i, j].item())[:valid]
            # the causal (finite-score) part of the selection is the same set; ties aside, same order
            torch.testing.assert_close(scores[bb, i, mine], scores[bb, i, ref])
            assert all(j <= i for j in mine)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="do not match q"):
        indexer_topk(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 7), torch.rand(4, 1, 2), 2)
