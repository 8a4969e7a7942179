"""DSA sparse attention over the indexer's top-k keys: the portable backend, O(s * topk) memory.

Contract of megatron-core 0.18's ``unfused_dsa_fn(query, key, value, topk_indices, softmax_scale)``:
query ``[sq, b, np, hn]``, key ``[skv, b, np, hn]``, value ``[skv, b, np, hnv]``, topk_indices
``[b, sq, topk]`` (shared by all heads, MLA/MQA style; duplicates and positions after the query
count once / not at all), causal; returns ``[sq, b, np * hnv]`` in value's dtype, softmax in fp32.
Key and value may also have one head (``[skv, b, 1, hn]``, absorbed MLA / MQA): every query head
shares it. A query with no valid key gets a zero output and zero gradients.

megatron's reference materialises ``[b, np, sq, skv]`` fp32 scores (hundreds of GB at 32k). This
backend walks the queries in chunks of at most ``topk`` rows; per chunk it builds the chunk's
selection mask over the causal key prefix (``[b, rows, prefix]`` bools) and runs PyTorch's
``scaled_dot_product_attention`` with it, so each platform's own attention kernel does the work
(CUDA: the memory-efficient kernel, which takes a mask; NPU/CPU: their fused or math kernels).
Nothing but q, k, v and the indices is kept for backward: each chunk's attention is recomputed
there and differentiated on its own, so peak memory is one chunk's mask and attention buffers,
O(s * topk), never O(s^2). Runs on NPU, CUDA and CPU; it is the numerical reference for the
Triton and Ascend backends.

One key head (absorbed MLA / MQA): the query heads are folded into query rows against the single
key head (q ``[b, 1, np * rows, d]``, the mask repeated per head) instead of expanding key and value
to every head. An expanded key is a stride-0 head dimension, and PyTorch's memory-efficient CUDA
kernel returns wrong outputs (errors of 2-4 absolute) for such inputs at key lengths like 257, 513
and 1025 (seen with PyTorch 2.11.0+cu130 on an nvidia-h200; the math kernel and contiguous inputs are right).

Deterministic runs (``torch.use_deterministic_algorithms(True)``, verl's deterministic mode): SDPA
runs its math kernel, whose backward has no atomics, so every call gives bitwise-equal results; the
chunk budget then counts the fp32 scores that kernel materialises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from verl_npu.ops.chunking import DSA_ATTENTION_CHUNK_ELEMENTS

CHUNK_BUDGET_ELEMENTS = DSA_ATTENTION_CHUNK_ELEMENTS


def _chunk_rows(sq: int, skv: int, b: int, heads: int, topk: int, budget_elements: int, fused_mask_kernel: bool,
                kv_heads: int | None = None) -> int:  # fmt: skip
    """Query rows per chunk: at most topk (O(s * topk) memory) and within the element budget.

    Where SDPA has a fused kernel that takes a mask (CUDA) a row costs its mask, once per sequence of
    the batch; elsewhere SDPA may materialise fp32 scores for every head too, so ``b * heads * skv``.
    With one key head the mask is repeated per query head (the fold in ``_chunk_attention``), so a
    row costs ``b * heads * skv`` there too.
    """
    shared_mask = fused_mask_kernel and (kv_heads is None or kv_heads == heads or heads == 1)
    per_row = b * skv if shared_mask else b * heads * skv
    return max(1, min(sq, topk, budget_elements // max(per_row, 1)))


def _selection_mask(topk_indices: torch.Tensor, rows: slice, skv: int) -> torch.Tensor:
    """[b, rows, skv] bool: key j is selected for query i and j <= i (duplicates collapse)."""
    idx = topk_indices[:, rows].long()
    b, n, _ = idx.shape
    # out-of-range entries (-1 padding) land in a spare last column that is dropped: a clamped write
    # of False onto a real key would unselect it when the same row also selected that key
    mask = torch.zeros(b, n, skv + 1, dtype=torch.bool, device=idx.device)
    idx = torch.where((idx >= 0) & (idx < skv), idx, skv)
    mask.scatter_(-1, idx, True)
    positions = torch.arange(rows.start, rows.start + n, device=idx.device)
    causal = torch.arange(skv, device=idx.device).unsqueeze(0) <= positions.unsqueeze(1)
    return mask[..., :skv] & causal.unsqueeze(0)


def _sdpa(q, k, v, mask, scale):
    if torch.are_deterministic_algorithms_enabled():
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _chunk_attention(q, k, v, mask, scale, heads):
    """Attention of one query chunk. q: [b, np, rows, hn]; k/v: [b, 1 or np, prefix, d]; mask: [b, rows, prefix]."""
    has_key = mask.any(-1)  # [b, rows]
    everyone_has_a_key = bool(has_key.all())
    if not everyone_has_a_key:
        # an all-False row would make the softmax 0/0; give it key 0, then zero its output (and so its gradients)
        mask = mask.clone()
        mask[..., 0] |= ~has_key
    if k.shape[1] == 1 and heads > 1:
        # fold the heads into rows against the one key head, never expand it (module docstring)
        b, _, rows, _ = q.shape
        folded_mask = mask.unsqueeze(1).expand(b, heads, rows, mask.shape[-1]).reshape(b, 1, heads * rows, -1)
        out = _sdpa(q.reshape(b, 1, heads * rows, q.shape[-1]), k, v, folded_mask, scale)
        out = out.view(b, heads, rows, v.shape[-1])
    else:
        out = _sdpa(q, k, v, mask.unsqueeze(1), scale)
    if not everyone_has_a_key:
        out = out * has_key[:, None, :, None].to(out.dtype)
    return out


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topk_indices, scale, chunk):
        # q/k/v: [b, np or 1, s, d] views; the result is [sq, b, np, hnv], the layout megatron returns
        b, heads, sq, skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        result = torch.empty(sq, b, heads, v.shape[-1], dtype=v.dtype, device=v.device)
        out = result.permute(1, 2, 0, 3)
        for start in range(0, sq, chunk):
            rows = slice(start, min(start + chunk, sq))
            end = min(rows.stop, skv)  # causal: keys after the chunk's last query are never used
            mask = _selection_mask(topk_indices, rows, skv)[..., :end]
            out[:, :, rows] = _chunk_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end], mask, scale, heads)
        ctx.save_for_backward(q, k, v, topk_indices)
        ctx.scale, ctx.chunk = scale, chunk
        return result

    @staticmethod
    def backward(ctx, grad_result):
        q, k, v, topk_indices = ctx.saved_tensors
        grad_out = grad_result.permute(1, 2, 0, 3)
        scale, chunk = ctx.scale, ctx.chunk
        heads, sq, skv = q.shape[1], q.shape[2], k.shape[2]
        dq = torch.empty_like(q)
        # keys collect gradient from every later chunk: accumulate in fp32
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for start in range(0, sq, chunk):
            rows = slice(start, min(start + chunk, sq))
            end = min(rows.stop, skv)
            mask = _selection_mask(topk_indices, rows, skv)[..., :end]
            with torch.enable_grad():
                qc = q[:, :, rows].detach().requires_grad_()
                kc = k[:, :, :end].detach().requires_grad_()
                vc = v[:, :, :end].detach().requires_grad_()
                out = _chunk_attention(qc, kc, vc, mask, scale, heads)
                dqc, dkc, dvc = torch.autograd.grad(out, (qc, kc, vc), grad_out[:, :, rows])
            dq[:, :, rows] = dqc
            dk[:, :, :end] += dkc
            dv[:, :, :end] += dvc
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    chunk_budget_elements: int = CHUNK_BUDGET_ELEMENTS,
) -> torch.Tensor:
    """``unfused_dsa_fn``'s result (same layouts and dtype), with O(s * topk) memory; differentiable."""
    sq, b, heads, _ = query.shape
    skv = key.shape[0]
    if topk_indices.shape[:2] != (b, sq):
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)}: expected [b={b}, sq={sq}, topk]")
    kv_heads = key.shape[2]
    if key.shape[1] != b or kv_heads not in (1, heads) or value.shape[:3] != (skv, b, kv_heads):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}: "
            f"expected [skv, b={b}, {heads} or 1 heads, dim] for both"
        )
    topk = topk_indices.shape[-1]
    fused = query.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled()
    chunk = _chunk_rows(sq, skv, b, heads, topk, chunk_budget_elements, fused, kv_heads)
    # [s, b, np, d] -> [b, np, s, d] views: SDPA takes strided inputs, so nothing is copied
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    result = _SparseAttention.apply(q, k, v, topk_indices, float(softmax_scale), chunk)
    return result.view(sq, b, heads * value.shape[-1])
