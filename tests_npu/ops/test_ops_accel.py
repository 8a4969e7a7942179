"""The ops on a real accelerator (accel tier): Triton RMSNorm and the portable DSA attention on CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.accel


def test_triton_rms_norm_matches_fp32_at_glm5_width():
    pytest.importorskip("triton", reason="Triton is not installed")
    if not torch.cuda.is_available():
        pytest.skip("the Triton backend runs on CUDA")
    from verl_npu.ops import dispatch
    from verl_npu.ops.rmsnorm import rms_norm

    assert dispatch.backend_for("rms_norm", torch.device("cuda")) == "triton"
    x = torch.randn(4096, 6144, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = (torch.rand(6144, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_()
    y, h = dispatch.rms_norm(x, w, 1e-6, residual=r)
    gy = torch.randn_like(y)
    ((y * gy).float().sum() + h.float().sum()).backward()
    leaves = [t.detach().float().requires_grad_() for t in (x, w, r)]
    h32 = leaves[0] + leaves[2]
    y32 = rms_norm(h32, leaves[1], 1e-6)
    ((y32 * gy.float()).sum() + h32.sum()).backward()
    torch.testing.assert_close(y.float(), y32, atol=2e-2, rtol=2e-2)
    for mine, ref in zip((x.grad, w.grad, r.grad), leaves, strict=True):
        scale = ref.grad.abs().max()
        torch.testing.assert_close(mine.float() / scale, ref.grad / scale, atol=2e-2, rtol=2e-2)


def test_portable_dsa_attention_matches_megatron_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from verl_npu.ops.dsa_attention import sparse_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    s, heads, dim, topk = 512, 8, 64, 96
    q, k, v = (torch.randn(s, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    rows = torch.arange(s, device="cuda").view(1, s, 1)
    idx = (torch.rand(1, s, topk, device="cuda", generator=gen) * (rows + 1)).floor().long()
    idx[..., 0] = rows[..., 0]  # every query keeps itself
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, ref = sparse_attention(*ours, idx, dim**-0.5), unfused_dsa_fn(*theirs, idx, dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad, other.grad, atol=3e-2, rtol=3e-2)


def _dense_float64(q, k, v, idx, scale):
    """Selection-masked causal attention in float64 on the device: [sq, b, np * hnv]."""
    sq, b = q.shape[:2]
    skv = k.shape[0]
    q64, k64, v64 = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or 1, s, d]
    scores = (q64 @ k64.transpose(-1, -2)) * scale  # [b, heads, sq, skv]
    selected = torch.zeros(b, sq, skv + 1, dtype=torch.bool, device=q.device)
    selected.scatter_(-1, torch.where((idx >= 0) & (idx < skv), idx, skv).long(), True)
    causal = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
    keep = (selected[..., :skv] & causal).unsqueeze(1)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return (probs @ v64).permute(2, 0, 1, 3).reshape(sq, b, -1)


@pytest.mark.parametrize("s", [257, 513, 1025])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hn", "hnv"), [(64, 64), (576, 512)])
def test_portable_dsa_attention_with_one_key_head_is_right_when_a_chunk_spans_the_whole_sequence(s, dtype, hn, hnv):
    """Issue 18: with one key head (absorbed MLA / MQA) and top-k >= s, the portable backend returned
    outputs off by 2-4 at key lengths 257/513/1025 on CUDA: the head-expanded key (stride 0) broke
    PyTorch's memory-efficient attention kernel. Against float64 dense attention, values and grads."""
    from verl_npu.ops.dsa_attention import sparse_attention

    device = "cuda" if torch.cuda.is_available() else "npu"
    gen = torch.Generator(device=device).manual_seed(s)
    b, heads = 2, 8
    q = torch.randn(s, b, heads, hn, device=device, generator=gen).to(dtype)
    k = torch.randn(s, b, 1, hn, device=device, generator=gen).to(dtype)
    v = torch.randn(s, b, 1, hnv, device=device, generator=gen).to(dtype)
    rows = torch.arange(s, device=device).view(1, s, 1)
    idx = torch.arange(s + 7, device=device).view(1, 1, -1).expand(b, s, -1).contiguous()  # every key, + padding
    idx = torch.where(idx <= rows, idx, -1)
    scale = hn**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attention(*leaves, idx, scale)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = _dense_float64(*ref_leaves, idx, scale)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max().item() < tol
    grad = torch.randn(out.shape, device=device, generator=gen).to(dtype)
    out.backward(grad)
    ref.backward(grad.double())
    for mine, theirs, name in zip(leaves, ref_leaves, "qkv", strict=True):
        err = (mine.grad.double() - theirs.grad).abs().max().item() / theirs.grad.abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"d{name}: relative error {err:.3g}"
