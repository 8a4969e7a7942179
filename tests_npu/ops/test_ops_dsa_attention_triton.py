"""The Triton DSA sparse attention under the interpreter (CPU), against the explicit masked dense formula.

The kernels run in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be set before Triton
is imported). The selection bitmask and tile lists are plain PyTorch and are checked in process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")

from verl_npu.ops import dsa_attention_triton as dsa

KERNEL_PARITY = textwrap.dedent(
    """
    import torch
    from verl_npu.ops import dsa_attention_triton as dsa

    def selected(idx, sq, skv):
        # [b, sq, skv] bool, straight from the contract: listed (once or more), in range, not after the query
        b = idx.shape[0]
        mask = torch.zeros(b, sq, skv + 1, dtype=torch.bool)
        idx = idx.long().clone()
        idx[(idx < 0) | (idx >= skv)] = skv  # a spare column for ignored entries
        mask.scatter_(-1, idx, True)
        return mask[..., :skv] & torch.ones(sq, skv, dtype=torch.bool).tril()

    def reference(q, k, v, idx, scale):
        # dense scores, -inf outside (selected & causal), fp32 softmax; a row with no key gives 0
        sq, b, heads, _ = q.shape
        k, v = k.expand(-1, -1, heads, -1), v.expand(-1, -1, heads, -1)
        scores = torch.einsum("ibhd,jbhd->bhij", q, k) * scale
        scores = scores.masked_fill(~selected(idx, sq, k.shape[0])[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return torch.einsum("bhij,jbhd->ibhd", probs, v).reshape(sq, b, -1)

    def indices(gen, b, sq, skv, topk):
        idx = torch.randint(0, max(skv, 1), (b, sq, topk), generator=gen)
        idx[..., 0] = torch.arange(sq).clamp(max=skv - 1)  # most rows keep their own position
        idx[..., 1] = idx[..., 2]  # duplicates count once
        idx[..., -1] = -1  # padding
        idx[0, sq // 2] = -1  # a query with no valid key ...
        idx[-1, sq - 1, 2:] = skv + 3  # ... and indices past the keys, ignored
        return idx

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()

    # (sq, skv, b, heads, kv_heads, hn, hnv, topk, dtype, (BLOCK_M, BLOCK_N), query as a strided view)
    CASES = [
        (37, 37, 2, 3, 3, 24, 16, 8, torch.float32, (16, 32), True),  # odd sizes, hn != hnv, padded dims
        (19, 19, 1, 2, 2, 16, 16, 40, torch.float32, (16, 64), False),  # top-k > s; two bitmask words a tile
        (1, 1, 1, 2, 2, 16, 16, 4, torch.float32, (16, 32), False),  # one query
        (20, 29, 1, 2, 2, 16, 16, 9, torch.float32, (16, 32), False),  # more keys than queries
        (29, 20, 1, 2, 2, 16, 16, 9, torch.float32, (16, 32), False),  # fewer keys than queries
        (37, 37, 2, 3, 3, 24, 16, 8, torch.bfloat16, (16, 32), True),
    ]
    gen = torch.Generator().manual_seed(0)
    for sq, skv, b, heads, kv_heads, hn, hnv, topk, dtype, blocks, strided in CASES:
        dsa.INTERPRETER_CONFIG = (*blocks, 1, 1)
        q = torch.randn(b, sq, heads, hn, generator=gen).to(dtype).transpose(0, 1)  # [sq, b, ...], strided
        q = q if strided else q.contiguous()
        k = torch.randn(skv, b, kv_heads, hn, generator=gen).to(dtype)
        v = torch.randn(skv, b, kv_heads, hnv, generator=gen).to(dtype)
        idx = indices(gen, b, sq, skv, topk)
        scale = hn**-0.5
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dsa.sparse_attention_triton(*leaves, idx, scale)
        grad = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(grad)
        # the reference in fp64 from the very same (rounded) inputs
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = reference(*ref_leaves, idx, scale)
        ref.backward(grad.double())
        name = f"sq={sq} skv={skv} b={b} heads={heads}/{kv_heads} {dtype} blocks={blocks}"
        assert out.shape == (sq, b, heads * hnv) and out.dtype == dtype, name
        assert torch.equal(out[sq // 2, 0], torch.zeros_like(out[sq // 2, 0])), name + ": row without keys"
        for got, want, what in zip((out, *(t.grad for t in leaves)), (ref, *(t.grad for t in ref_leaves)),
                                   ("out", "dq", "dk", "dv"), strict=True):  # fmt: skip
            assert got.shape == want.shape and got.dtype == dtype, f"{name} {what}"
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=f"{name} {what}")
            else:
                assert rel(got.double(), want) < 1.5e-2, f"{name} {what}: relative error {rel(got.double(), want)}"
    print("ok")
    """
)


def test_forward_and_backward_match_the_masked_dense_formula_under_the_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_PARITY],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr[-3000:]


def _dense_selection(idx: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    mask = torch.zeros(idx.shape[0], sq, skv, dtype=torch.bool)
    for b, i, j in (idx >= 0).nonzero().tolist():
        key = int(idx[b, i, j])
        if key < skv and key <= i:
            mask[b, i, key] = True
    return mask


def _decode(bits: torch.Tensor, skv: int) -> torch.Tensor:
    keys = torch.arange(skv)
    return ((bits[..., keys // 32] >> (keys % 32)) & 1).bool()


@pytest.mark.parametrize("chunk_elements", [1, 2**24])  # one query row a chunk, and all rows at once
def test_the_selection_bitmask_holds_exactly_the_selected_causal_keys(monkeypatch, chunk_elements):
    monkeypatch.setattr(dsa, "BITMASK_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(1)
    b, sq, skv, topk = 2, 70, 75, 30
    idx = torch.randint(-2, skv + 3, (b, sq, topk), generator=gen)
    idx[..., 0] = 31  # bit 31: int32's sign bit
    idx[..., 1] = 63
    idx[..., 2] = idx[..., 3]
    bits = dsa._selection_bits(idx.to(torch.int32), sq, skv)
    assert bits.shape == (b, sq, 3) and bits.dtype == torch.int32
    assert torch.equal(_decode(bits, skv), _dense_selection(idx, sq, skv))
    assert bits[0, 40, 0] < 0  # key 31 selected by query 40: the sign bit is set, nothing spilled over
    assert ((bits[..., 2] >> (skv - 64)) == 0).all()  # no bits past the last key


def test_tile_lists_name_exactly_the_occupied_tiles_in_order():
    b, sq, skv = 1, 50, 100
    idx = torch.full((b, sq, 2), -1)
    idx[0, 5, 0] = 3  # tile (0, 0) with 16-row, 32-key tiles
    idx[0, 40, 0] = 35  # tile (2, 1)
    idx[0, 49, 1] = 49  # tile (3, 1)
    idx[0, 20, 1] = 99  # after the query: no tile
    bits = dsa._selection_bits(idx, sq, skv)
    occupied = dsa._occupancy(bits, 16, 32, skv)
    assert occupied.shape == (1, 4, 4)
    assert occupied.nonzero().tolist() == [[0, 0, 0], [0, 2, 1], [0, 3, 1]]
    counts, blocks = dsa._tile_lists(occupied)
    assert counts.tolist() == [[1, 0, 1, 1]] and blocks[0, 0, 0] == 0 and blocks[0, 2, 0] == blocks[0, 3, 0] == 1
    counts, blocks = dsa._tile_lists(occupied.transpose(1, 2))  # per key block: its query blocks, ascending
    assert counts.tolist() == [[1, 2, 0, 0]] and blocks[0, 1, :2].tolist() == [2, 3]
    wide = dsa._occupancy(bits, 32, 64, skv)  # coarser tiles from the same bitmask
    assert wide.nonzero().tolist() == [[0, 0, 0], [0, 1, 0]]


def test_bad_inputs_are_refused_with_the_reason():
    q, k, v = torch.randn(8, 1, 4, 16), torch.randn(8, 1, 4, 16), torch.randn(8, 1, 4, 16)
    idx = torch.zeros(1, 8, 2, dtype=torch.long)
    fn = dsa.sparse_attention_triton
    with pytest.raises(ValueError, match=r"topk_indices \(1, 7, 2\): expected \[b=1, sq=8, topk\]"):
        fn(q, k, v, idx[:, :7], 1.0)
    with pytest.raises(ValueError, match="expected an integer dtype"):
        fn(q, k, v, idx.float(), 1.0)
    with pytest.raises(ValueError, match=r"expected \[s, b, heads, head_dim\] each"):
        fn(q[..., 0], k, v, idx, 1.0)
    with pytest.raises(ValueError, match="do not match query"):
        fn(q, k[..., :8], v, idx, 1.0)
    with pytest.raises(ValueError, match="do not match query"):
        fn(q, k, v[:, :, :1], idx, 1.0)
    with pytest.raises(ValueError, match=r"key/value have 2 heads: expected 4 \(one per query head\)"):
        fn(q, k[:, :, :2], v[:, :, :2], idx, 1.0)
    # one key head shared by every query head is the gather kernel's (the dispatcher routes it there)
    with pytest.raises(ValueError, match=r"have 1 heads: expected 4 .*sparse_attention_mqa_triton"):
        fn(q, k[:, :, :1], v[:, :, :1], idx, 1.0)
    with pytest.raises(ValueError, match="expected one of bf16, fp16, fp32 for all"):
        fn(q, k.bfloat16(), v, idx, 1.0)
    with pytest.raises(ValueError, match="expected one of bf16, fp16, fp32 for all"):
        fn(q.double(), k.double(), v.double(), idx, 1.0)
