"""The MQA / absorbed-MLA Triton DSA kernel against the portable backend on CUDA (accel tier), GLM-5 head sizes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.accel


@pytest.fixture(autouse=True)
def _needs_cuda_and_triton():
    pytest.importorskip("triton", reason="Triton is not installed")
    if not torch.cuda.is_available():
        pytest.skip("the Triton DSA kernels run on CUDA")


def _inputs(s, heads, hn, hnv, topk, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s, 1, heads, hn, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(s, 1, 1, hn, device="cuda", generator=gen).to(torch.bfloat16)
    rows = torch.arange(s, device="cuda").view(1, s, 1)
    # uniform causal draws with repeats, every query keeps itself; the last slots hold positions after
    # the query (what the indexer's top-k returns past the causal prefix). -1 padding is left to the
    # CPU tests against the dense formula.
    idx = (torch.rand(1, s, topk, device="cuda", generator=gen) * (rows + 1)).floor().long()
    idx[..., 0] = rows[..., 0]
    idx[..., -3:] = (rows + 1).clamp(max=s - 1)
    return q, kv, idx


@pytest.mark.parametrize("value_is_key_prefix", [True, False], ids=["absorbed_mla", "separate_value"])
def test_triton_mqa_is_as_close_to_fp32_as_the_portable_backend_at_glm5_head_sizes(value_is_key_prefix):
    pytest.importorskip("triton", reason="Triton is not installed")
    if not torch.cuda.is_available():
        pytest.skip("the Triton backend runs on CUDA")
    from verl_npu.ops.dsa_attention import sparse_attention
    from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton

    s, heads, hn, hnv, topk = 1024, 64, 576, 512, 256
    q, kv, idx = _inputs(s, heads, hn, hnv, topk)
    separate = torch.randn(s, 1, 1, hnv, device="cuda", dtype=torch.bfloat16)
    scale = 192**-0.5  # GLM-5: qk_head_dim + rope dim, as megatron's absorbed MLA keeps it
    grad = torch.randn(s, 1, heads * hnv, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()

    def run(fn, dtype):
        leaves = [q.to(dtype, copy=True).requires_grad_(), kv.to(dtype, copy=True).requires_grad_()]
        if value_is_key_prefix:
            value = leaves[1][..., :hnv]
        else:
            leaves.append(separate.to(dtype, copy=True).requires_grad_())
            value = leaves[2]
        out = fn(leaves[0], leaves[1], value, idx, scale)
        out.backward(grad.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    ours = run(sparse_attention_mqa_triton, torch.bfloat16)
    portable = run(sparse_attention, torch.bfloat16)
    reference = run(sparse_attention, torch.float32)
    # each result's error against fp32, relative to the largest reference entry. The kernel rounds P and
    # dS to bf16 for the tensor-core products (as flash attention does), so it may sit a little above the
    # portable backend; a wrong or missing key would be off by far more than the 5e-3 allowed on top
    for name, mine, theirs, ref in zip(("out", "dq", "dk", "dv"), ours, portable, reference, strict=False):
        size = ref.abs().max()
        err, portable_err = ((mine - ref).abs().max() / size).item(), ((theirs - ref).abs().max() / size).item()
        assert err <= 2 * portable_err + 5e-3, f"{name}: error {err:.2e} vs the portable backend's {portable_err:.2e}"
