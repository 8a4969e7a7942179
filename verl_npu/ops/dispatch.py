"""One dispatch point per op: the best backend available for the tensors' device.

Backends: ``ascend`` (torch_npu's fused operators, NPU tensors), ``triton`` (CUDA tensors, Triton
installed), ``portable`` (plain PyTorch; NPU, CUDA and CPU; the numerical reference). An op without
a kernel for the preferred backend falls through to the next. ``VERL_NPU_OPS_BACKEND`` forces one
backend for every op that has it (it must be available for the tensors' device, or the call fails
loudly); ops without that backend choose as usual.

A fused Ascend operator takes a narrower set of inputs than its op's contract (e.g.
npu_sparse_flash_attention takes absorbed-MLA keys only, megatron passes per-head ones). Its
adapter (verl_npu.ops.ascend) then refuses the inputs before calling it, and the op runs its
portable backend, logging why once per reason: the result is the same, only slower, and a model
whose shapes never fit would otherwise stop at its first layer. With ``VERL_NPU_OPS_BACKEND=ascend``
the refusal is an error instead: the fused kernel was asked for, and quietly running another
would hide that it never ran (a benchmark would measure the wrong kernel).

Deterministic runs (``torch.use_deterministic_algorithms(True)``): every op gives bitwise-equal
results on equal inputs. The one-key-head Triton DSA kernel accumulates key gradients with atomics,
so those inputs run the portable backend (math attention kernel) instead, logged like any fallback.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re

import torch

from verl_npu.ops.triton_support import TRITON_DTYPES

logger = logging.getLogger(__name__)

BACKENDS = ("ascend", "triton", "portable")
# which backends each op has, best first
OPS = {
    "rms_norm": ("ascend", "triton", "portable"),
    "dsa_sparse_attention": ("ascend", "triton", "portable"),
    "dsa_indexer_topk": ("ascend", "portable"),
    "dsa_indexer_loss": ("ascend", "portable"),
    "hadamard_transform": ("portable",),
}
# the tiled Triton DSA kernel's tiles are sized for GLM-5's per-head dims (256); beyond, portable runs
TRITON_TILED_MAX_HEAD_DIM = 256


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
        # an op without that backend at all chooses as usual (a model also runs ops that only one backend
        # has, e.g. the Hadamard transform); an op that has it must be able to run it on these tensors
        if forced in OPS[op]:
            if not _usable(forced, device):
                raise RuntimeError(
                    f"VERL_NPU_OPS_BACKEND={forced}: op {op} has no {forced} kernel for {device.type} tensors "
                    f"(it has: {', '.join(OPS[op])}); unset it to choose automatically"
                )
            return forced
    return next(b for b in OPS[op] if _usable(b, device))


_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def _fall_back(op: str, backend: str, reason: str) -> None:
    """The portable backend runs instead of ``backend``: an error when that backend was forced, else logged
    the first time an op falls back for this kind of reason (shapes aside: sequence lengths vary)."""
    if os.environ.get("VERL_NPU_OPS_BACKEND") == backend:
        raise RuntimeError(
            f"VERL_NPU_OPS_BACKEND={backend}: {op}: {reason}; unset it to run these inputs on the portable backend"
        )
    kind = (op, re.sub(r"\d+", "#", reason))
    if kind not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add(kind)
        logger.warning("verl_npu.ops: %s runs its portable backend: %s", op, reason)


def _ascend(op: str, call):
    """``call(verl_npu.ops.ascend)``, or None when the operator refuses the inputs (see the module docstring)."""
    from verl_npu.ops import ascend

    try:
        return call(ascend)
    except ascend.OperatorUnfit as unfit:
        _fall_back(op, "ascend", str(unfit))  # a forced-backend error raised here chains the refusal
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (of ``x + residual``, also returned); fp32 statistics, x's dtype out."""
    backend = backend_for("rms_norm", x.device)
    if backend == "ascend":
        from verl_npu.ops import ascend

        return ascend.rms_norm(x, weight, eps, residual)
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
    backend = backend_for("dsa_sparse_attention", query.device)
    if backend == "ascend":
        out = _ascend(
            "dsa_sparse_attention", lambda a: a.sparse_flash_attention(query, key, value, topk_indices, softmax_scale)
        )
        if out is not None:
            return out
    if backend == "triton":
        dtypes = {query.dtype, key.dtype, value.dtype}
        if len(dtypes) != 1 or query.dtype not in TRITON_DTYPES:
            reason = f"dtypes {query.dtype}/{key.dtype}/{value.dtype}: the Triton kernels take one of bf16, fp16, fp32"
        elif key.shape[2] == 1 and torch.are_deterministic_algorithms_enabled():
            reason = (
                "torch.use_deterministic_algorithms(True): the one-key-head Triton kernel's backward adds key "
                "gradients with atomics (not bitwise repeatable); the portable backend is deterministic"
            )
        elif key.shape[2] == 1:  # one key head shared by every query head (absorbed MLA / MQA): gather kernel
            from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton

            return sparse_attention_mqa_triton(query, key, value, topk_indices, softmax_scale)
        elif max(query.shape[-1], value.shape[-1]) <= TRITON_TILED_MAX_HEAD_DIM:
            from verl_npu.ops.dsa_attention_triton import sparse_attention_triton

            return sparse_attention_triton(query, key, value, topk_indices, softmax_scale)
        else:
            reason = (
                f"per-head keys with head dims {query.shape[-1]}/{value.shape[-1]}: the tiled Triton kernel is "
                f"built for head dims up to {TRITON_TILED_MAX_HEAD_DIM} (larger tiles overflow shared memory)"
            )
        _fall_back("dsa_sparse_attention", "triton", reason)
    from verl_npu.ops.dsa_attention import sparse_attention

    return sparse_attention(query, key, value, topk_indices, softmax_scale)


def dsa_indexer_topk(q, k, weights, topk: int, *, causal: bool = True):
    """The DSA indexer's top-k keys per query, O(chunk * s) memory (see verl_npu.ops.dsa_indexer)."""
    if backend_for("dsa_indexer_topk", q.device) == "ascend":
        out = _ascend("dsa_indexer_topk", lambda a: a.lightning_indexer_topk(q, k, weights, topk, causal=causal))
        if out is not None:
            return out
    from verl_npu.ops.dsa_indexer import indexer_topk

    return indexer_topk(q, k, weights, topk, causal=causal)


def dsa_indexer_loss(
    q, weights, k, query, key, topk_indices, softmax_scale: float, loss_coeff: float, sparse_loss: bool = False,
    *, tp_group=None,
):  # fmt: skip
    """The DSA indexer's KL loss, differentiable w.r.t. q, weights, k (see verl_npu.ops.dsa_indexer_loss).

    ``tp_group``: the tensor-parallel group the attention heads are split over (None: all heads here).
    """
    if tp_group is not None and torch.distributed.get_world_size(tp_group) == 1:
        tp_group = None
    args = (q, weights, k, query, key, topk_indices, softmax_scale, loss_coeff, sparse_loss)
    if backend_for("dsa_indexer_loss", q.device) == "ascend":
        out = _ascend("dsa_indexer_loss", lambda a: a.indexer_kl_loss(*args, tp_group=tp_group))
        if out is not None:
            return out
    from verl_npu.ops.dsa_indexer_loss import indexer_kl_loss

    return indexer_kl_loss(*args, tp_group=tp_group)


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``fast_hadamard_transform.hadamard_transform``'s contract (see verl_npu.ops.hadamard)."""
    backend_for("hadamard_transform", x.device)
    from verl_npu.ops.hadamard import hadamard_transform as portable

    return portable(x, scale)
