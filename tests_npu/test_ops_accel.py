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
