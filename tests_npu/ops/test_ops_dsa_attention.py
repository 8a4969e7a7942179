"""The portable DSA sparse attention against megatron-core 0.18's explicit masked dense formula."""

from __future__ import annotations

import pytest
import torch

from verl_npu.ops.dsa_attention import sparse_attention


def reference(query, key, value, topk_indices, scale):
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    return unfused_dsa_fn(query, key, value, topk_indices, scale)


def inputs(sq, b, heads, hn, hnv, topk, dtype, seed=0, duplicates=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, hn, generator=gen).to(dtype)
    k = torch.randn(sq, b, heads, hn, generator=gen).to(dtype)
    v = torch.randn(sq, b, heads, hnv, generator=gen).to(dtype)
    # like the indexer: top-k of causal scores, so every query selects itself first among valid keys
    scores = torch.randn(b, sq, sq, generator=gen)
    scores = scores.masked_fill(torch.ones(sq, sq, dtype=torch.bool).triu(1), float("-inf"))
    scores.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    idx = scores.topk(min(topk, sq), dim=-1).indices
    if topk > sq:  # top-k larger than the sequence: pad with positions after the query (masked)
        idx = torch.cat([idx, torch.full((b, sq, topk - sq), sq - 1)], dim=-1)
    if duplicates:
        idx[..., -1] = idx[..., 0]
    return q, k, v, idx


@pytest.mark.parametrize(
    ("sq", "b", "heads", "hn", "hnv", "topk", "chunk_budget"),
    [
        (37, 2, 3, 24, 16, 8, 2**27),  # odd sizes, MLA-like hn != hnv
        (64, 1, 4, 32, 32, 16, 4 * 64),  # tiny budget: one query row per chunk
        (19, 1, 2, 16, 16, 40, 2**27),  # top-k larger than the sequence
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_megatrons_masked_dense_formula(sq, b, heads, hn, hnv, topk, chunk_budget, dtype):
    q, k, v, idx = inputs(sq, b, heads, hn, hnv, topk, dtype, duplicates=topk < sq)
    scale = hn**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ours = sparse_attention(*leaves, idx, scale, chunk_budget_elements=chunk_budget)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = reference(*ref_leaves, idx, scale)
    assert ours.shape == theirs.shape == (sq, b, heads * hnv) and ours.dtype == theirs.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ours, theirs, **tol)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    for mine, ref, name in zip(leaves, ref_leaves, "qkv", strict=True):
        torch.testing.assert_close(mine.grad, ref.grad, **tol, msg=f"d{name}")


def test_a_query_attends_only_to_its_selected_causal_keys():
    q, k, v, idx = inputs(16, 1, 2, 8, 8, 4, torch.float32, seed=3)
    out = sparse_attention(q, k, v, idx, 0.3)
    changed = v.clone()
    selected = set(idx[0, 10].tolist())
    for j in range(16):
        if j not in selected or j > 10:
            changed[j] += 100.0  # keys query 10 does not attend to
    again = sparse_attention(q, k, changed, idx, 0.3)
    torch.testing.assert_close(out[10], again[10])
    assert not torch.allclose(out[15], again[15])


def test_shape_mismatches_are_refused():
    q, k, v, idx = inputs(8, 1, 2, 8, 8, 4, torch.float32)
    with pytest.raises(ValueError, match=r"topk_indices \(1, 7, 4\): expected \[b=1, sq=8, topk\]"):
        sparse_attention(q, k, v, idx[:, :7], 1.0)
    with pytest.raises(ValueError, match="do not match query"):
        sparse_attention(q, k[:, :, :1], v, idx, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_head_keys_are_shared_by_every_query_head_like_absorbed_mla(dtype):
    q, k, v, idx = inputs(23, 2, 4, 16, 8, 6, dtype, seed=5)
    k1, v1 = k[:, :, :1].clone(), v[:, :, :1].clone()
    mine = [t.clone().requires_grad_() for t in (q, k1, v1)]
    ours = sparse_attention(*mine, idx, 0.25)
    theirs_leaves = [t.clone().requires_grad_() for t in (q, k1, v1)]
    tq, tk, tv = theirs_leaves
    theirs = reference(tq, tk.expand(-1, -1, 4, -1), tv.expand(-1, -1, 4, -1), idx, 0.25)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(ours, theirs, **tol)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    assert mine[1].grad.shape == (23, 2, 1, 16)  # summed over the four query heads
    for a, r, name in zip(mine, theirs_leaves, "qkv", strict=True):
        torch.testing.assert_close(a.grad, r.grad, **tol, msg=f"d{name}")


def test_a_query_without_any_valid_key_gets_zero_output_and_zero_gradient():
    q, k, v, idx = inputs(12, 1, 2, 8, 8, 3, torch.float32, seed=7)
    idx[0, 5] = -1  # padding only: query 5 selects nothing
    idx[0, 8] = 11  # only keys after the query: nothing causal
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attention(*leaves, idx, 0.3)
    assert torch.isfinite(out).all()
    assert torch.equal(out[5], torch.zeros_like(out[5])) and torch.equal(out[8], torch.zeros_like(out[8]))
    out.sum().backward()
    assert torch.equal(leaves[0].grad[5], torch.zeros_like(leaves[0].grad[5]))
    assert torch.equal(leaves[0].grad[8], torch.zeros_like(leaves[0].grad[8]))
    assert leaves[0].grad[4].abs().sum() > 0 and torch.isfinite(leaves[1].grad).all()
    # the other queries are exactly what megatron's formula gives (its rows 5 and 8 are NaN: 0/0)
    ref = reference(q, k, v, idx.clamp(min=0), 0.3)
    keep = [i for i in range(12) if i not in (5, 8)]
    torch.testing.assert_close(out[keep], ref[keep])


def test_padding_after_a_selected_key_does_not_unselect_it():
    q, k, v, idx = inputs(6, 1, 1, 4, 4, 3, torch.float32, seed=11)
    idx[0, 5] = torch.tensor([0, -1, 7])  # key 0 selected, then padding and an out-of-range entry
    out = sparse_attention(q, k, v, idx, 0.5)
    # a single selected key: the softmax puts all weight on it, so the output is exactly v[0]
    torch.testing.assert_close(out[5], v[0].reshape(1, -1))


def test_chunks_shrink_with_the_batch_so_one_chunk_stays_within_the_budget():
    from verl_npu.ops.dsa_attention import CHUNK_BUDGET_ELEMENTS, _chunk_rows

    s, heads, topk = 32768, 64, 2048
    for b in (1, 8):
        fused = _chunk_rows(s, s, b, heads, topk, CHUNK_BUDGET_ELEMENTS, fused_mask_kernel=True)
        math = _chunk_rows(s, s, b, heads, topk, CHUNK_BUDGET_ELEMENTS, fused_mask_kernel=False)
        assert fused * b * s <= CHUNK_BUDGET_ELEMENTS and math * b * heads * s <= CHUNK_BUDGET_ELEMENTS
    assert _chunk_rows(s, s, 1, heads, topk, CHUNK_BUDGET_ELEMENTS, True) == 2048  # capped by top-k
    assert _chunk_rows(s, s, 8, heads, topk, CHUNK_BUDGET_ELEMENTS, True) == 512
    # one key head: the mask is repeated per query head (heads folded into rows), so a row costs b * heads * s
    folded = _chunk_rows(s, s, 1, heads, topk, CHUNK_BUDGET_ELEMENTS, True, kv_heads=1)
    assert folded * heads * s <= CHUNK_BUDGET_ELEMENTS < (folded + 1) * heads * s
