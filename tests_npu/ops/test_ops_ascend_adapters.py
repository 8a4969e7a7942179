"""verl_npu.ops.ascend through stand-ins of the torch_npu operators (tests_npu/support/fake_torch_npu.py).

The stand-ins assert each operator's documented input rules, so these tests check that the
adapters hand torch_npu what it accepts, and that what comes back equals the portable backend.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from support import fake_torch_npu

from verl_npu.ops import ascend, dispatch
from verl_npu.ops.dsa_attention import sparse_attention
from verl_npu.ops.dsa_indexer import indexer_topk
from verl_npu.ops.dsa_indexer_loss import indexer_kl_loss
from verl_npu.ops.rmsnorm import rms_norm

LATENT = ascend.LATENT_DIM + ascend.ROPE_DIM


@pytest.fixture
def npu(monkeypatch):
    """torch_npu is the stand-in module; the dispatcher treats CPU tensors as NPU tensors for "ascend"."""
    fake = fake_torch_npu.module()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    usable = dispatch._usable
    monkeypatch.setattr(dispatch, "_usable", lambda backend, device: backend == "ascend" or usable(backend, device))
    monkeypatch.delenv("VERL_NPU_OPS_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_FALLBACKS_LOGGED", set())
    return fake


def randn(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def causal_topk(b, sq, topk, seed):
    """Random top-k sets in megatron's form: repeats and keys after the query allowed, each row with a causal key."""
    idx = torch.randint(0, sq, (b, sq, topk), generator=torch.Generator().manual_seed(seed))
    idx[..., 0] = idx[..., 0].minimum(torch.arange(sq))
    return idx


# --- RMSNorm -----------------------------------------------------------------------------------


def test_rms_norm_goes_through_npu_rms_norm_with_gamma_in_x_dtype(npu):
    x, r = randn(4, 16, seed=0), randn(4, 16, seed=1)
    w = torch.rand(16) + 0.5  # fp32 parameter, bf16 activations: torch_npu takes gamma in x's dtype only
    y, h = dispatch.rms_norm(x, w, 1e-5, residual=r)
    assert npu.CALLS == ["npu_rms_norm"] and torch.equal(h, x + r)
    torch.testing.assert_close(y, rms_norm(x + r, w.to(torch.bfloat16), 1e-5))


# --- indexer top-k -----------------------------------------------------------------------------


@pytest.mark.parametrize(("topk", "causal"), [(6, True), (50, True), (6, False)])
def test_lightning_indexer_selects_the_portable_keys(npu, topk, causal):
    sq, b, heads = 37, 2, 8
    q, k, w = randn(sq, b, heads, 128, seed=0), randn(sq, b, 128, seed=1), randn(sq, b, heads, seed=2).abs()
    ours = dispatch.dsa_indexer_topk(q, k, w, topk, causal=causal)
    portable = indexer_topk(q, k, w, topk, causal=causal)
    assert npu.CALLS == ["npu_lightning_indexer"]
    assert ours.dtype == torch.long and ours.shape == portable.shape == (b, sq, min(topk, sq))
    for bb in range(b):
        for i in range(sq):
            theirs = set(portable[bb, i].tolist())
            if causal:  # only the causal part of megatron's selection means anything (the rest is -inf padding)
                theirs = {j for j in theirs if j <= i}
                assert max(ours[bb, i].tolist()) <= i and min(ours[bb, i].tolist()) >= 0
            assert set(ours[bb, i].tolist()) == theirs, (bb, i)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(dtype=torch.float32), "bfloat16 or float16 inputs of one dtype; got q=torch.float32"),
        (dict(dim=64), r"index head dim 128; got q \(8, 1, 4, 64\)"),
        (dict(heads=65), "1..64 index heads; got 65"),
        (dict(topk=2500, sq=2600, skv=2600), "or a multiple of 1024 up to 8192; asked for 2500"),
        (dict(skv=9), "agree only for sq == skv; got sq=8, skv=9"),
    ],
)
def test_lightning_indexer_refuses_inputs_outside_its_contract(npu, change, message):
    shape = dict(sq=8, skv=8, heads=4, dim=128, topk=4, dtype=torch.bfloat16) | change
    sq, skv, heads, dim = shape["sq"], shape["skv"], shape["heads"], shape["dim"]
    q, k = randn(sq, 1, heads, dim, seed=0, dtype=shape["dtype"]), randn(skv, 1, dim, seed=1, dtype=shape["dtype"])
    with pytest.raises(ascend.OperatorUnfit, match=message):
        ascend.lightning_indexer_topk(q, k, randn(sq, 1, heads, seed=2), shape["topk"])
    assert npu.CALLS == []


def test_lightning_indexer_asks_for_a_long_top_k_it_takes_and_keeps_the_rows_keys(npu):
    """sparse_count is 1..2048 or a multiple of 1024 up to 8192: a 3072 top-k over 2100 keys asks for 3072
    (the operator pads with -1) and returns each row's 2100 best, as the portable backend does."""
    sq, b, heads, topk = 2100, 1, 2, 3072
    q, k, w = randn(sq, b, heads, 128, seed=0), randn(sq, b, 128, seed=1), randn(sq, b, heads, seed=2).abs()
    ours = dispatch.dsa_indexer_topk(q, k, w, topk)
    assert npu.CALLS == ["npu_lightning_indexer"] and ours.shape == (b, sq, sq)
    portable = indexer_topk(q, k, w, topk)
    for i in (0, 1, 700, sq - 1):
        assert set(ours[0, i].tolist()) == {j for j in portable[0, i].tolist() if j <= i}, i


# --- sparse attention --------------------------------------------------------------------------


def test_sparse_indices_are_distinct_causal_keys_first_then_minus_one():
    idx = torch.tensor([[[3, 0, 3, 9], [1, 1, 0, 2], [2, 5, -1, 0]]])  # rows 0..2 of a 4-key sequence
    expected = torch.tensor([[[[0, -1, -1, -1]], [[0, 1, -1, -1]], [[0, 2, -1, -1]]]], dtype=torch.int32)
    assert torch.equal(ascend.sparse_indices(idx, 4), expected)


def absorbed(sq, b, heads, seed):
    """(query, latent key with its rope channels) in the MQA form npu_sparse_flash_attention takes."""
    return randn(sq, b, heads, LATENT, seed=seed), randn(sq, b, 1, LATENT, seed=seed + 1)


def test_sparse_flash_attention_matches_megatrons_dense_attention_forward_and_backward(npu):
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    sq, b, heads, scale = 24, 2, 4, LATENT**-0.5
    query, latent = (t.requires_grad_() for t in absorbed(sq, b, heads, seed=0))
    idx = causal_topk(b, sq, 6, seed=3)
    key = latent * 1.0  # a non-leaf, as the model's key is; value is its first 512 channels
    out = dispatch.dsa_sparse_attention(query, key, key[..., : ascend.LATENT_DIM], idx, scale)
    assert npu.CALLS == ["npu_sparse_flash_attention"]
    grad = randn(*out.shape, seed=9)
    d_query, d_latent = torch.autograd.grad(out, (query, latent), grad)

    # megatron's dense reference in fp32, the shared key expanded to every head
    q32, k32 = (t.detach().float().requires_grad_() for t in (query, latent))
    keys = k32.expand(-1, -1, heads, -1)
    ref = unfused_dsa_fn(q32, keys, keys[..., : ascend.LATENT_DIM], idx, scale)
    ref_query, ref_latent = torch.autograd.grad(ref, (q32, k32), grad.float())
    assert out.shape == ref.shape == (sq, b, heads * ascend.LATENT_DIM) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for mine, theirs in ((d_query, ref_query), (d_latent, ref_latent)):
        scale_ = theirs.abs().max()
        torch.testing.assert_close(mine.float() / scale_, theirs / scale_, atol=1e-2, rtol=0)
    # and the portable backend, which takes the one-head key too, gives the same result
    portable = sparse_attention(query.detach(), key.detach(), key.detach()[..., : ascend.LATENT_DIM], idx, scale)
    torch.testing.assert_close(out.detach().float(), portable.float(), atol=2e-2, rtol=2e-2)


def test_per_head_keys_fall_back_to_portable_with_one_log_line_or_fail_when_ascend_is_forced(npu, caplog, monkeypatch):
    sq, b, heads = 10, 1, 2
    query, key, value = randn(sq, b, heads, 16, seed=0), randn(sq, b, heads, 16, seed=1), randn(sq, b, heads, 8, seed=2)
    idx = causal_topk(b, sq, 3, seed=0)
    with caplog.at_level(logging.WARNING, logger="verl_npu.ops.dispatch"):
        for _ in range(3):
            out = dispatch.dsa_sparse_attention(query, key, value, idx, 0.25)
        for other in (7, 9):  # RL batches change length: still the same reason, no new line
            dispatch.dsa_sparse_attention(
                query[:other], key[:other], value[:other], causal_topk(b, other, 3, seed=1), 0.25
            )
    assert npu.CALLS == []
    torch.testing.assert_close(out, sparse_attention(query, key, value, idx, 0.25))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "dsa_sparse_attention runs its portable backend" in lines[0]
    assert "takes one key head shared by every query head; got key (10, 1, 2, 16) with 2 heads" in lines[0]
    monkeypatch.setenv("VERL_NPU_OPS_BACKEND", "ascend")
    with pytest.raises(RuntimeError, match=r"VERL_NPU_OPS_BACKEND=ascend: dsa_sparse_attention: .* with 2 heads"):
        dispatch.dsa_sparse_attention(query, key, value, idx, 0.25)


def test_sparse_flash_attention_takes_values_in_memory_of_their_own_and_refuses_odd_shapes(npu):
    query, key = absorbed(8, 1, 4, seed=0)
    idx = causal_topk(1, 8, 3, seed=0)
    shared = ascend.sparse_flash_attention(query, key, key[..., :512], idx, 0.1)
    own = ascend.sparse_flash_attention(query, key, key[..., :512].clone(), idx, 0.1)  # not aliasing the key
    assert npu.CALLS == ["npu_sparse_flash_attention"] * 2 and torch.equal(shared, own)
    npu.CALLS.clear()
    with pytest.raises(ascend.OperatorUnfit, match=r"latent values \[skv, b, 1, 512\].*got value \(8, 1, 1, 256\)"):
        ascend.sparse_flash_attention(query, key, key[..., :256], idx, 0.1)
    query3 = randn(8, 1, 3, LATENT, seed=5)
    with pytest.raises(ascend.OperatorUnfit, match=r"query heads; got 3"):
        ascend.sparse_flash_attention(query3, key, key[..., :512], idx, 0.1)
    with pytest.raises(ascend.OperatorUnfit, match=r"head dim 512 \(latent\) \+ 64 \(rope\) = 576"):
        ascend.sparse_flash_attention(query[..., :320], key[..., :320], key[..., :256], idx, 0.1)
    assert npu.CALLS == []


# --- indexer KL loss ---------------------------------------------------------------------------


def kl_inputs(sq, b, attn_heads, index_heads, seed):
    query, key = absorbed(sq, b, attn_heads, seed)
    q, k = randn(sq, b, index_heads, 128, seed=seed + 2), randn(sq, b, 128, seed=seed + 3)
    # moderate index logits: megatron's loss adds 1e-10 inside its logs, which tells apart probabilities < ~1e-6
    weights = randn(sq, b, index_heads, seed=seed + 4, scale=0.05)
    return q, weights, k, query, key


def test_fused_kl_loss_matches_the_portable_loss_and_gradients(npu):
    sq, b, scale, coeff = 20, 2, LATENT**-0.5, 0.7
    q, weights, k, query, key = kl_inputs(sq, b, 32, 8, seed=0)  # top-k 5: padded with -1 to the 1024 it takes
    idx = indexer_topk(q, k, weights, 5)
    fused = [t.clone().requires_grad_() for t in (q, weights, k)]
    loss = dispatch.dsa_indexer_loss(*fused, query, key, idx, scale, coeff, True)
    (loss * 1.5).backward()
    assert npu.CALLS == ["npu_sparse_flash_attention", "npu_sparse_lightning_indexer_grad_kl_loss"]
    portable = [t.clone().requires_grad_() for t in (q, weights, k)]
    ref = indexer_kl_loss(*portable, query, key, idx, scale, coeff, True)
    (ref * 1.5).backward()
    assert ref.item() > 0.05
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, mine, theirs in zip(("dq", "dweights", "dk"), fused, portable, strict=True):
        assert mine.grad.dtype == theirs.grad.dtype == torch.bfloat16, name
        scale_ = theirs.grad.float().abs().max()
        torch.testing.assert_close(mine.grad.float() / scale_, theirs.grad.float() / scale_, atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("dense", "computes the sparse .top-k. loss only"),
        ("per_head", "takes one key head shared by every query head"),
        ("tp", "with tensor parallelism the target needs every rank's heads"),
        ("heads", r"indexer heads; got 4"),
        ("attention_heads", r"\(32, 64, 128\) attention heads; got 16"),
        ("topk", "up to 8192 keys per row; got a top-k of 8193"),
    ],
)
def test_the_kl_loss_falls_back_where_the_fused_operator_does_not_fit(npu, caplog, case, message):
    attention_heads = 16 if case == "attention_heads" else 32
    q, weights, k, query, key = kl_inputs(12, 1, attention_heads, 4 if case == "heads" else 8, seed=1)
    if case == "per_head":
        key = key.expand(-1, -1, attention_heads, -1)
    idx = indexer_topk(q, k, weights, 4)
    if case == "topk":
        idx = idx[..., :1].expand(-1, -1, 8193)  # repeats are allowed in a top-k set
    sparse = case != "dense"
    tp = object() if case == "tp" else None  # reaches the adapter only: the portable loss gets no group here
    with pytest.raises(ascend.OperatorUnfit, match=message):
        ascend.indexer_kl_loss(q, weights, k, query, key, idx, 0.05, 1.0, sparse, tp_group=tp)
    if case != "tp":
        with caplog.at_level(logging.WARNING, logger="verl_npu.ops.dispatch"):
            loss = dispatch.dsa_indexer_loss(q, weights, k, query, key, idx, 0.05, 1.0, sparse)
        torch.testing.assert_close(loss, indexer_kl_loss(q, weights, k, query, key, idx, 0.05, 1.0, sparse))
        assert len(caplog.records) == 1 and "dsa_indexer_loss runs its portable backend" in caplog.records[0].message
    assert npu.CALLS == []
