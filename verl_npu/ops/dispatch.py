"""One dispatch point per op: the best backend available for the tensors' device.

Backends: ``ascend`` (torch_npu's fused operators, NPU tensors), ``triton`` (CUDA tensors, Triton
installed), ``portable`` (plain PyTorch; NPU, CUDA and CPU; the numerical reference). An op without
a kernel for the preferred backend falls through to the next. ``VERL_NPU_OPS_BACKEND`` forces one
backend for every op (it must be available for the tensors' device, or the call fails loudly).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("ascend", "triton", "portable")
# which backends each op has, best first
OPS = {
    "rms_norm": ("ascend", "triton", "portable"),
    "dsa_sparse_attention": ("portable",),
    "dsa_indexer_topk": ("portable",),
}


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _usable(backend: str, device: torch.device) -> bool:
    if backend == "portable":
        return True
    if backend == "ascend":
        return device.type == "npu"
    if backend == "triton":
        return _triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    return False


def backend_for(op: str, device: torch.device) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    forced = os.environ.get("VERL_NPU_OPS_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"VERL_NPU_OPS_BACKEND={forced!r}: choose one of {', '.join(BACKENDS)}")
        if forced not in OPS[op] or not _usable(forced, device):
            raise RuntimeError(
                f"VERL_NPU_OPS_BACKEND={forced}: op {op} has no {forced} kernel for {device.type} tensors "
                f"(it has: {', '.join(OPS[op])}); unset it to choose automatically"
            )
        return forced
    return next(b for b in OPS[op] if _usable(b, device))


def _rms_norm_ascend(x, weight, eps, residual):
    import torch_npu

    if residual is not None:
        x = x + residual
    # npu_rms_norm wants gamma in x's dtype; it returns (y, rstd)
    y = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return (y, x) if residual is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (of ``x + residual``, also returned); fp32 statistics, x's dtype out."""
    backend = backend_for("rms_norm", x.device)
    if backend == "ascend":
        return _rms_norm_ascend(x, weight, eps, residual)
    if backend == "triton":
        from verl_npu.ops.rmsnorm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    from verl_npu.ops.rmsnorm import rms_norm as portable

    if residual is not None:
        h = x + residual
        return portable(h, weight, eps), h
    return portable(x, weight, eps)


def dsa_sparse_attention(query, key, value, topk_indices, softmax_scale):
    """megatron's ``unfused_dsa_fn`` contract over the top-k keys only (see verl_npu.ops.dsa_attention)."""
    backend_for("dsa_sparse_attention", query.device)
    from verl_npu.ops.dsa_attention import sparse_attention

    return sparse_attention(query, key, value, topk_indices, softmax_scale)


def dsa_indexer_topk(q, k, weights, topk: int, *, causal: bool = True):
    """The DSA indexer's top-k keys per query, O(chunk * s) memory (see verl_npu.ops.dsa_indexer)."""
    backend_for("dsa_indexer_topk", q.device)
    from verl_npu.ops.dsa_indexer import indexer_topk

    return indexer_topk(q, k, weights, topk, causal=causal)
