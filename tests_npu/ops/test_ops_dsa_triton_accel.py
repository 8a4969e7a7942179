"""The Triton DSA sparse attention on CUDA (accel tier): against the portable backend and megatron's unfused_dsa_fn."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.accel

S, HEADS, DIM, TOPK = 1024, 8, 256, 256


@pytest.fixture(autouse=True)
def _needs_cuda_and_triton():
    pytest.importorskip("triton", reason="Triton is not installed")
    if not torch.cuda.is_available():
        pytest.skip("the Triton DSA kernels run on CUDA")


def _inputs(dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, 1, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    k = torch.randn(S, 1, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(S, 1, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    # the indexer's shape of selection: top-k of causally masked scores, the query itself kept;
    # rows shorter than top-k pick masked (future) positions, which must be ignored
    scores = torch.rand(1, S, S, device="cuda", generator=gen)
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    scores.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    idx = scores.topk(TOPK, dim=-1).indices
    idx[..., -1] = idx[..., 0]  # a duplicate counts once
    return q, k, v, idx


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(fn, tensors, idx, grad):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves, idx, DIM**-0.5)
    out.backward(grad)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_triton_matches_the_portable_backend_and_megatron_forward_and_backward(dtype, tol):
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from verl_npu.ops.dsa_attention import sparse_attention
    from verl_npu.ops.dsa_attention_triton import sparse_attention_triton

    q, k, v, idx = _inputs(dtype)
    grad = torch.randn(S, 1, HEADS * DIM, device="cuda").to(dtype)
    ours, our_grads = _run(sparse_attention_triton, (q, k, v), idx, grad)
    assert ours.shape == (S, 1, HEADS * DIM) and ours.dtype == dtype
    for name, fn in (("portable", sparse_attention), ("megatron", unfused_dsa_fn)):
        ref, ref_grads = _run(fn, (q, k, v), idx, grad)
        assert _rel(ours, ref) < tol, f"output vs {name}: {_rel(ours, ref):.2e}"
        for mine, theirs, grad_name in zip(our_grads, ref_grads, ("dq", "dk", "dv"), strict=True):
            assert mine.dtype == dtype
            assert _rel(mine, theirs) < tol, f"{grad_name} vs {name}: {_rel(mine, theirs):.2e}"
