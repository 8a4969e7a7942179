"""DSA sparse attention over the indexer's top-k keys: the portable backend, O(s * topk) memory.

Contract of megatron-core 0.18's ``unfused_dsa_fn(query, key, value, topk_indices, softmax_scale)``:
query ``[sq, b, np, hn]``, key ``[skv, b, np, hn]``, value ``[skv, b, np, hnv]``, topk_indices
``[b, sq, topk]`` (shared by all heads, MLA/MQA style; duplicates and positions after the query
count once / not at all), causal; returns ``[sq, b, np * hnv]`` in value's dtype, softmax in fp32.

megatron's reference materialises ``[b, np, sq, skv]`` fp32 scores (hundreds of GB at 32k). This
backend walks the queries in chunks of at most ``topk`` rows: per chunk it scores only the causal
key prefix, masks everything outside the chunk's top-k sets, and keeps the softmax statistics
(log-sum-exp) instead of the probabilities. Backward recomputes each chunk's probabilities from
those statistics (the flash-attention recurrence, done chunk by chunk in PyTorch), so peak memory
is a few ``[b, np, chunk, skv]`` buffers: O(s * topk), never O(s^2). Runs on NPU, CUDA and CPU.
"""

from __future__ import annotations

import torch


def _chunk_rows(sq: int, skv: int, heads: int, topk: int, budget_elements: int) -> int:
    """Query rows per chunk: at most topk (O(s * topk) memory) and within the element budget."""
    by_budget = max(budget_elements // max(heads * skv, 1), 1)
    return max(1, min(sq, topk, by_budget))


def _selection_mask(topk_indices: torch.Tensor, rows: slice, skv: int) -> torch.Tensor:
    """[b, rows, skv] bool: key j is selected for query i and j <= i (duplicates collapse)."""
    idx = topk_indices[:, rows].long()
    b, n, _ = idx.shape
    mask = torch.zeros(b, n, skv, dtype=torch.bool, device=idx.device)
    valid = (idx >= 0) & (idx < skv)
    mask.scatter_(-1, idx.clamp(0, skv - 1), valid)
    positions = torch.arange(rows.start, rows.start + n, device=idx.device)
    causal = torch.arange(skv, device=idx.device).unsqueeze(0) <= positions.unsqueeze(1)
    return mask & causal.unsqueeze(0)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """[b, np, rows, skv] fp32 scores with -inf outside the mask. q: [b, np, rows, hn], k: [b, np, skv, hn].

    Matmuls run in the inputs' dtype (bf16 accumulates in fp32 on every backend), softmax in fp32.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    return scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, topk_indices, scale, chunk):
        # q/k/v here are [b, np, s, d]
        b, heads, sq, _ = q.shape
        skv = k.shape[2]
        out = torch.empty(b, heads, sq, v.shape[-1], dtype=v.dtype, device=v.device)
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=q.device)
        for start in range(0, sq, chunk):
            rows = slice(start, min(start + chunk, sq))
            end = min(rows.stop, skv)  # causal: keys after the chunk's last query are never used
            mask = _selection_mask(topk_indices, rows, skv)[..., :end]
            scores = _scores(q[:, :, rows], k[:, :, :end], mask, scale)
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores.sub_(row_lse.unsqueeze(-1))).nan_to_num_(0.0)  # rows with no key: all -inf
            out[:, :, rows] = torch.matmul(probs.to(v.dtype), v[:, :, :end])
            lse[:, :, rows] = row_lse
        ctx.save_for_backward(q, k, v, topk_indices, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, topk_indices, out, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        sq, skv = q.shape[2], k.shape[2]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        grad_out = grad_out.contiguous()
        # delta_i = sum_d dO_i * O_i: the softmax-backward row term
        delta = (grad_out.float() * out.float()).sum(-1)
        compute = q.dtype  # matmul inputs in the model's dtype, as flash attention does; statistics in fp32
        for start in range(0, sq, chunk):
            rows = slice(start, min(start + chunk, sq))
            end = min(rows.stop, skv)
            mask = _selection_mask(topk_indices, rows, skv)[..., :end]
            scores = _scores(q[:, :, rows], k[:, :, :end], mask, scale)
            probs = torch.exp(scores.sub_(lse[:, :, rows].unsqueeze(-1))).nan_to_num_(0.0)
            do = grad_out[:, :, rows].to(compute)
            dv[:, :, :end] += torch.matmul(probs.to(compute).transpose(-1, -2), do)
            dprobs = torch.matmul(do, v[:, :, :end].transpose(-1, -2)).float()
            dscores = probs.mul_(dprobs.sub_(delta[:, :, rows].unsqueeze(-1))).mul_(scale).to(compute)
            dq[:, :, rows] = torch.matmul(dscores, k[:, :, :end])
            dk[:, :, :end] += torch.matmul(dscores.transpose(-1, -2), q[:, :, rows])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    chunk_budget_elements: int = 2**25,
) -> torch.Tensor:
    """``unfused_dsa_fn``'s result (same layouts and dtype), with O(s * topk) memory; differentiable."""
    sq, b, heads, _ = query.shape
    skv = key.shape[0]
    if topk_indices.shape[:2] != (b, sq):
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)}: expected [b={b}, sq={sq}, topk]")
    if key.shape[1:3] != (b, heads) or value.shape[:3] != (skv, b, heads):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}")
    topk = topk_indices.shape[-1]
    chunk = _chunk_rows(sq, skv, b * heads, topk, chunk_budget_elements)
    # [s, b, np, d] -> [b, np, s, d]
    q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
    out = _SparseAttention.apply(q, k, v, topk_indices, float(softmax_scale), chunk)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])
