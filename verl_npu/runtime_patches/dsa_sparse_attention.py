"""DSA's sparse attention over the top-k keys in O(s * topk) memory instead of a dense [b, np, s, s].

Changes: replaces ``megatron.core...dsa.unfused_dsa_fn`` with ``verl_npu.ops.dispatch.dsa_sparse_attention``
(same arguments, layouts, dtype and masking: causal, top-k shared by all heads, softmax in fp32).
Why: megatron-core 0.18's reference materialises fp32 scores for every head and every key and masks
all but the top-k: 256 GiB per layer at GLM-5's 32k context and 64 heads, so DSA cannot run without
Ascend's fused operators (older CANN, the fused flags off, CUDA dev boxes, CPU tests). Measured on
nvidia-h200 at s=4k: 15x less memory and 3.3x faster, and s=32k runs in 7.4 GiB (bench/results/kernels_h200.json).
On Ascend with the fused DSA flags MindSpeed replaces DSAttention's forward and this is not called.
It also reports the top-k it runs with to verl_npu.engine.index_share (GLM-5.2's shared layers
reuse the most recent full layer's top-k).
Upstream: megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py (unfused_dsa_fn,
called by DSAttention.forward).
Remove when: megatron-core's DSA computes attention over the selected keys only.
"""

from __future__ import annotations

from verl_npu.patching import Patch
from verl_npu.runtime_patches._targets import DSA_MODULE, EVERY_PLATFORM, MEGATRON_CORE


def _build(original):
    from verl_npu.engine import index_share
    from verl_npu.ops import dispatch

    def unfused_dsa_fn(query, key, value, topk_indices, softmax_scale):
        index_share.publish(topk_indices)  # a full IndexShare layer's top-k, for the shared layers after it
        return dispatch.dsa_sparse_attention(query, key, value, topk_indices, softmax_scale)

    unfused_dsa_fn.__doc__ = dispatch.dsa_sparse_attention.__doc__
    return unfused_dsa_fn


PATCH = Patch(
    id="dsa-sparse-attention",
    target=f"{DSA_MODULE}:unfused_dsa_fn",
    kind="replace",
    platforms=EVERY_PLATFORM,
    requires=MEGATRON_CORE,
    source_sha256="c841056b66af4b8b3fa420820f68424ad52948096f4b8169d97a4ed216adeba6",
    reason="megatron's reference DSA attention is dense (O(s^2) per head); the dispatcher's backends (torch_npu, "
    "Triton, portable chunks) keep it O(s * topk) in memory",
    upstream="megatron-core 0.18.0 transformer/experimental_attention_variant/dsa.py::unfused_dsa_fn",
    remove_when="megatron-core's DSA attention is sparse (memory proportional to top-k)",
    build=_build,
)
PATCHES = (PATCH,)
