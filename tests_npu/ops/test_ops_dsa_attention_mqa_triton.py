"""The MQA / absorbed-MLA Triton DSA kernel under the interpreter against the explicit masked dense formula.

The kernels run on CPU with ``TRITON_INTERPRET=1``, which must be set before Triton is imported,
so each group of cases runs in a subprocess that imports this module and calls ``run_group``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def dense_reference(query, key, value, topk_indices, scale):
    """Dense fp32 scores, -inf outside selected & causal, fp32 softmax; a query without keys gives 0."""
    sq, b, heads, _ = query.shape
    skv = key.shape[0]
    scores = torch.einsum("ibhd,jbd->bhij", query.float(), key[:, :, 0].float()) * scale
    selected = torch.zeros(b, sq, skv, dtype=torch.bool)
    for batch, row, slot in (topk_indices >= 0).logical_and(topk_indices < skv).nonzero().tolist():
        selected[batch, row, topk_indices[batch, row, slot]] = True
    allowed = selected & torch.ones(sq, skv, dtype=torch.bool).tril()
    has_key = allowed.any(-1)  # [b, sq]
    # rows without a key: finite scores there, then a zero multiplier, so their gradients are 0 not NaN
    scores = scores.masked_fill(~allowed[:, None] & has_key[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1) * has_key[:, None, :, None]
    out = torch.einsum("bhij,jbd->ibhd", probs, value[:, :, 0].float())
    return out.reshape(sq, b, heads * value.shape[-1])


def make_inputs(sq, b, heads, hn, hnv, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, hn, generator=gen)
    k = torch.randn(sq, b, 1, hn, generator=gen)
    v = torch.randn(sq, b, 1, hnv, generator=gen)
    rows = torch.arange(sq).view(1, sq, 1)
    # uniform causal draws (repeats happen), padding and out-of-range entries mixed in
    idx = (torch.rand(b, sq, topk, generator=gen) * (rows + 1)).floor().long()
    idx[..., 0] = rows[..., 0]
    idx[..., 1] = idx[..., 2]  # an explicit duplicate
    idx[..., -1] = -1
    idx[..., -2] = sq + 5  # out of range
    idx[0, 3] = -1  # query 3 of batch 0 selects nothing
    idx[-1, 6, :] = 9  # query 6 selects only a key after itself: nothing causal
    return q, k, v, idx


def _compare(dtype, q, k, v, idx, scale, view_mode=None):
    """Forward and backward of the kernel vs the dense formula (fp32, from the same rounded inputs)."""
    from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton

    hnv = v.shape[-1]
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.to(dtype).float().requires_grad_() for t in (q, k, v)]
    if view_mode == "view_of_key":  # absorbed MLA: value = key[..., :hnv], one leaf
        args, ref_args = [*leaves[:2], leaves[1][..., :hnv]], [*ref_leaves[:2], ref_leaves[1][..., :hnv]]
    elif view_mode == "aliased_leaves":  # same memory, independent leaves: gradients must stay apart
        alias = leaves[1].detach()[..., :hnv].requires_grad_()
        args, ref_args = [*leaves[:2], alias], [*ref_leaves[:2], ref_leaves[1].detach()[..., :hnv].requires_grad_()]
    else:
        args, ref_args = leaves, ref_leaves
    out = sparse_attention_mqa_triton(*args, idx, scale)
    ref = dense_reference(*ref_args, idx, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float(), ref, **tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    ref.backward(grad.float())
    grads = {"q": (leaves[0].grad, ref_leaves[0].grad), "k": (leaves[1].grad, ref_leaves[1].grad)}
    if view_mode is None:
        grads["v"] = (leaves[2].grad, ref_leaves[2].grad)
    elif view_mode == "aliased_leaves":
        grads["v"] = (args[2].grad, ref_args[2].grad)
    for name, (mine, theirs) in grads.items():
        scale_ = theirs.abs().max().clamp(min=1)
        torch.testing.assert_close(mine.float() / scale_, theirs / scale_, **tol, msg=f"d{name} {dtype}")
    # the queries without a key: zero output, zero query gradient
    assert torch.equal(out[3, 0].float(), torch.zeros(out.shape[-1]))
    assert torch.equal(leaves[0].grad[3, 0].float(), torch.zeros(leaves[0].grad.shape[-2:]))
    assert torch.equal(leaves[0].grad[6, -1].float(), torch.zeros(leaves[0].grad.shape[-2:]))


def run_group(group: str) -> None:
    import verl_npu.ops.dsa_attention_mqa_triton as mqa

    if group == "odd_sizes":
        # 16 heads (tl.dot's minimum rows), hn 40 = 32 + 8 (two pieces, the second padded), topk > s
        for dtype in (torch.float32, torch.bfloat16):
            _compare(dtype, *make_inputs(13, 2, 16, 40, 32, 20, seed=0), 40**-0.5)
        # 3 heads padded to 16 in the kernel; power-of-two hn (one piece); several key blocks per row
        _compare(torch.float32, *make_inputs(29, 1, 3, 32, 16, 40, seed=2), 0.2)
    elif group == "value_views":
        for dtype in (torch.float32, torch.bfloat16):
            _compare(dtype, *make_inputs(13, 2, 16, 40, 32, 12, seed=3), 0.15, view_mode="view_of_key")
        _compare(torch.float32, *make_inputs(13, 1, 16, 40, 32, 12, seed=4), 0.15, view_mode="aliased_leaves")
        # 20 heads: two programs per token (fp32 takes blocks of 16 heads), the second one padded
        assert mqa.FP32_CONFIG[0] == 16
        _compare(torch.float32, *make_inputs(29, 1, 20, 40, 32, 24, seed=5), 0.15, view_mode="view_of_key")
    elif group == "deterministic":
        q, k, v, idx = make_inputs(9, 1, 4, 16, 16, 4, seed=6)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.use_deterministic_algorithms(True)
        out = mqa.sparse_attention_mqa_triton(*leaves, idx, 0.25)  # the forward has no atomics
        try:
            out.sum().backward()
        except RuntimeError as exc:
            assert "sparse_attention_mqa_triton backward" in str(exc), exc
        else:
            raise AssertionError("the atomic backward ran under torch.use_deterministic_algorithms(True)")
    else:
        raise ValueError(group)
    print("ok")


def _run_interpreted(group: str) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import {Path(__file__).stem} as t; "
    code += f"t.run_group({group!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]


def test_forward_and_backward_match_the_masked_dense_formula_at_odd_sizes():
    _run_interpreted("odd_sizes")


def test_value_as_a_view_of_key_and_aliased_leaves_get_the_right_gradients():
    _run_interpreted("value_views")


def test_the_atomic_backward_refuses_by_name_under_deterministic_algorithms():
    _run_interpreted("deterministic")


def test_bad_shapes_and_per_head_keys_are_refused():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")
    from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton

    q, k, v, idx = make_inputs(8, 1, 4, 16, 16, 4, seed=0)
    with pytest.raises(ValueError, match=r"topk_indices \(1, 7, 4\): expected \[b=1, sq=8, topk\]"):
        sparse_attention_mqa_triton(q, k, v, idx[:, :7], 1.0)
    with pytest.raises(ValueError, match=r"one shared key/value head.*tiled Triton kernel.*portable backend"):
        sparse_attention_mqa_triton(q, k.expand(-1, -1, 4, -1), v.expand(-1, -1, 4, -1), idx, 1.0)
    with pytest.raises(ValueError, match="do not match query"):
        sparse_attention_mqa_triton(q, k[..., :8], v, idx, 1.0)
    with pytest.raises(ValueError, match=r"dtypes torch.float32/torch.float64/torch.float32: expected one of bf16"):
        sparse_attention_mqa_triton(q, k.double(), v, idx, 1.0)
    with pytest.raises(ValueError, match="must be integers"):
        sparse_attention_mqa_triton(q, k, v, idx.float(), 1.0)
