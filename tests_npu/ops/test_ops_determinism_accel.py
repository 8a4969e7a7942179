"""Deterministic runs: under ``torch.use_deterministic_algorithms(True)`` every dispatched op is bitwise repeatable.

verl's deterministic mode sets that flag; an op that cannot honour it must refuse with an error naming
itself, never return results that differ run to run (issue 18: the one-key-head Triton DSA kernel's
atomics made two backward passes differ by up to 8e-3 in bf16). Each case runs forward and backward
twice on equal inputs and compares every output and gradient bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from verl_npu.ops import dispatch

pytestmark = pytest.mark.accel


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace, read per call
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "npu"


def _twice(make_inputs, op):
    """(outputs, grads) of two runs on fresh copies of the same inputs."""
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in make_inputs()]
        out = op(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)
        total.backward()
        runs.append(([o.detach() for o in outs], [t.grad for t in leaves if t.grad is not None]))
    return runs


def _assert_bitwise_equal(runs, name):
    (outs_a, grads_a), (outs_b, grads_b) = runs
    assert grads_a and len(grads_a) == len(grads_b), f"{name}: no gradient reached the inputs"
    for i, (a, b) in enumerate(zip(outs_a + grads_a, outs_b + grads_b, strict=True)):
        assert a is not None and b is not None, f"{name}: tensor {i} has no value"
        assert torch.equal(a, b), f"{name}: tensor {i} differs by {(a.float() - b.float()).abs().max().item():.3g}"


def _attention_inputs(kv_heads, hn, hnv, s=1024, b=2, heads=16, topk=256, dtype=torch.bfloat16):
    device = _device()

    def make():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(s, b, heads, hn, device=device, generator=gen, dtype=torch.float32).to(dtype)
        k = torch.randn(s, b, kv_heads, hn, device=device, generator=gen, dtype=torch.float32).to(dtype)
        v = torch.randn(s, b, kv_heads, hnv, device=device, generator=gen, dtype=torch.float32).to(dtype)
        rows = torch.arange(s, device=device).view(1, s, 1)
        idx = (torch.rand(b, s, topk, device=device, generator=gen) * (rows + 1)).floor().long()
        return q, k, v, idx

    return make


@pytest.mark.parametrize(
    ("kv_heads", "hn", "hnv"),
    [(1, 576, 512), (16, 192, 128)],
    ids=["one-key-head-absorbed-mla", "per-head-keys"],
)
def test_dsa_sparse_attention_is_bitwise_repeatable(deterministic, kv_heads, hn, hnv):
    runs = _twice(_attention_inputs(kv_heads, hn, hnv), lambda q, k, v, idx: dispatch.dsa_sparse_attention(
        q, k, v, idx, hn**-0.5))  # fmt: skip
    _assert_bitwise_equal(runs, f"dsa_sparse_attention kv_heads={kv_heads}")


def test_rms_norm_is_bitwise_repeatable(deterministic):
    device = _device()

    def make():
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(4096, 6144, device=device, generator=gen).to(torch.bfloat16)
        r = torch.randn(4096, 6144, device=device, generator=gen).to(torch.bfloat16)
        return x, torch.rand(6144, device=device, generator=gen) + 0.5, r

    _assert_bitwise_equal(_twice(make, lambda x, w, r: dispatch.rms_norm(x, w, 1e-5, residual=r)), "rms_norm")


def test_dsa_indexer_loss_and_topk_are_bitwise_repeatable(deterministic):
    device = _device()
    s, b, heads, dim, attn_heads, hn = 1024, 1, 8, 128, 16, 192

    def make():
        gen = torch.Generator(device=device).manual_seed(2)
        q = torch.randn(s, b, heads, dim, device=device, generator=gen).to(torch.bfloat16)
        w = torch.randn(s, b, heads, device=device, generator=gen).to(torch.bfloat16)
        k = torch.randn(s, b, dim, device=device, generator=gen).to(torch.bfloat16)
        query = torch.randn(s, b, attn_heads, hn, device=device, generator=gen).to(torch.bfloat16)
        key = torch.randn(s, b, attn_heads, hn, device=device, generator=gen).to(torch.bfloat16)
        return q, w, k, query, key

    def loss(q, w, k, query, key):
        idx = dispatch.dsa_indexer_topk(q.detach(), k.detach(), w.detach(), 256)
        return dispatch.dsa_indexer_loss(q, w, k, query.detach(), key.detach(), idx, hn**-0.5, 0.01), idx

    runs = _twice(make, loss)
    _assert_bitwise_equal(runs, "dsa_indexer_topk + dsa_indexer_loss")


def test_the_one_key_head_triton_kernel_refuses_a_deterministic_backward_by_name(deterministic):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("the Triton kernels run on CUDA")
    from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton

    q, k, v, idx = _attention_inputs(1, 576, 512, s=256, topk=64)()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attention_mqa_triton(*leaves, idx, 576**-0.5)  # forward has no atomics: allowed
    with pytest.raises(RuntimeError, match="sparse_attention_mqa_triton backward"):
        out.sum().backward()
