"""The DSA indexer's KL loss in query chunks: O(chunk * s) memory, megatron-core 0.18's numbers.

Contract of megatron's ``FusedDSAIndexerLoss`` under DSAttention's causal mask
(``fwd_fused_indexer_loss_naive`` / ``compute_dsa_indexer_loss`` for the value,
``bwd_fused_indexer_loss_naive`` for the gradient). Inputs: the indexer's ``q [sq, b, h, d]``,
``weights [sq, b, h]``, ``k [sk, b, d]``; the main attention's ``query [sq, b, np, hn]`` and
``key [sk, b, np, hn]`` (or ``[sk, b, 1, hn]``: absorbed MLA / MQA, one key shared by every query
head); ``topk_indices [b, sq, topk]`` (the indexer's selection; duplicates count once, entries
outside ``[0, sk)`` are ignored). For query row ``t`` over keys ``j <= t``:

    p_t = sum over heads of softmax(scale * query_t . key_j), all-reduced over tensor parallelism
          (the heads are split across TP ranks), then L1-normalised
    i_t = softmax(sum_h relu(q_th . k_j) * w_th)
    loss = loss_coeff * mean over the b * sq rows of sum_j p_tj * (log(p_tj + 1e-10) - log(i_tj + 1e-10))

With ``sparse_loss`` both softmaxes run over the row's selected keys only (a row without a selected
causal key has no target and makes the loss NaN, in megatron's too; a causal top-k always holds
the row's first key). The gradient goes to q,
weights and k only (megatron detaches query and key from the indexer loss) and is the one
``bwd_fused_indexer_loss_naive`` computes, its 1e-10 terms included.

megatron builds ``[b, np, sq, sk]`` attention scores and ``[sq, b, h, sk]`` index scores in fp32 for
the whole sequence, in forward and again in backward (hundreds of GB per layer at 32k). Here each
chunk of query rows is scored over its causal key prefix only, reduced to its rows' loss terms (and
in backward to its rows' gradients) before the next chunk: peak memory is one chunk's
``[b, np + h, rows, sk]`` scores plus an fp32 copy of the key. Nothing but the inputs is kept
between forward and backward; backward recomputes each chunk. Runs on NPU, CUDA and CPU.
Measured on nvidia-h200 (b=1, 64 heads of dim 256, 32 index heads of dim 128, top-k 2048, bf16,
top-k + loss + gradients): s=4k 62.1 ms in 1.06 GiB, s=32k 4.6 s in 4.3 GiB, where megatron's asks
for 128 GiB (bench/results/kernels_h200.json).
"""

from __future__ import annotations

import torch

from verl_npu.ops.chunking import DSA_INDEXER_LOSS_CHUNK_ELEMENTS

EPS = 1e-10  # megatron's: inside both logs of the KL term and in its gradient
# Elements of one chunk's fp32 scores (attention heads + indexer heads, times rows, times keys).
CHUNK_BUDGET_ELEMENTS = DSA_INDEXER_LOSS_CHUNK_ELEMENTS


def _check(q, weights, k, query, key, topk_indices) -> None:
    sq, b, heads, dim = q.shape
    sk = k.shape[0]
    if k.shape != (sk, b, dim) or weights.shape != (sq, b, heads):
        raise ValueError(
            f"indexer k {tuple(k.shape)} / weights {tuple(weights.shape)} do not match q {tuple(q.shape)}: "
            f"expected k [sk, b={b}, d={dim}] and weights [sq={sq}, b={b}, h={heads}]"
        )
    if query.dim() != 4 or query.shape[:2] != (sq, b):
        raise ValueError(f"query {tuple(query.shape)}: expected [sq={sq}, b={b}, heads, dim] like the indexer q")
    if key.dim() != 4 or key.shape[:2] != (sk, b) or key.shape[2] not in (1, query.shape[2]):
        raise ValueError(
            f"key {tuple(key.shape)}: expected [sk={sk}, b={b}, {query.shape[2]} or 1 heads, dim] for query "
            f"{tuple(query.shape)}"
        )
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} head dims differ")
    if topk_indices.dim() != 3 or topk_indices.shape[:2] != (b, sq):
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)}: expected [b={b}, sq={sq}, topk]")


def _chunk_rows(sq: int, sk: int, b: int, heads: int, budget_elements: int) -> int:
    return max(1, min(sq, budget_elements // max(b * heads * sk, 1)))


def _valid(topk_indices: torch.Tensor, start: int, stop: int, end: int, sparse: bool) -> torch.Tensor:
    """[b or 1, rows, end] bool: key j is causal for the row (j <= t) and, with ``sparse``, selected."""
    device = topk_indices.device
    rows = torch.arange(start, stop, device=device)
    valid = (torch.arange(end, device=device).unsqueeze(0) <= rows.unsqueeze(1)).unsqueeze(0)
    if not sparse:
        return valid
    idx = topk_indices[:, start:stop].long()
    # entries outside [0, end) land in a spare column, so they can never clear a selected key
    idx = torch.where((idx >= 0) & (idx < end), idx, end)
    selected = torch.zeros(idx.shape[0], stop - start, end + 1, dtype=torch.bool, device=device)
    selected.scatter_(-1, idx, True)
    return valid & selected[..., :end]


class _Operands:
    """The inputs in the layouts the chunks read, fp32 as megatron computes (built once per pass)."""

    def __init__(self, q, weights, k, query, key):
        self.sq, self.b, self.heads, self.dim = q.shape
        self.sk = k.shape[0]
        self.attn_heads, self.key_heads = query.shape[2], key.shape[2]
        self.q, self.weights, self.query = q, weights, query
        self.k32 = k.float().permute(1, 2, 0)  # [b, d, sk]
        self.key32 = key.float().permute(1, 2, 3, 0).contiguous()  # [b, np or 1, hn, sk]

    def indexer_query(self, rows: slice) -> torch.Tensor:
        """[b, rows * h, d] fp32."""
        return self.q[rows].float().permute(1, 0, 2, 3).reshape(self.b, -1, self.dim)

    def index_scores(self, rows: slice, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head pre-ReLU scores [b, rows, h, end], weights [b, rows, h] and their weighted sum [b, rows, end]."""
        n = rows.stop - rows.start
        per_head = torch.bmm(self.indexer_query(rows), self.k32[:, :, :end]).view(self.b, n, self.heads, end)
        w = self.weights[rows].float().permute(1, 0, 2)
        return per_head, w, (per_head.relu() * w.unsqueeze(-1)).sum(2)

    def attention_target(self, rows: slice, end: int, valid: torch.Tensor, scale: float) -> torch.Tensor:
        """Per-head softmax of the scaled attention scores over the valid keys, summed over heads: [b, rows, end]."""
        n = rows.stop - rows.start
        query = self.query[rows].float().permute(1, 2, 0, 3)  # [b, np, rows, hn]
        keys = self.key32[..., :end]
        if self.key_heads == 1:  # one key for every head: a single bmm, no expanded copy of the key
            scores = torch.bmm(query.reshape(self.b, self.attn_heads * n, -1), keys[:, 0])
            scores = scores.view(self.b, self.attn_heads, n, end)
        else:
            scores = torch.matmul(query, keys)
        scores.mul_(scale).masked_fill_(~valid.unsqueeze(1), float("-inf"))
        return torch.softmax(scores, dim=-1).sum(1)


def _target_and_index(ops: _Operands, topk_indices, scale, sparse, tp_group, rows: slice):
    """(p, softmax(i), pre-ReLU per-head index scores, weights, valid) for one chunk of query rows."""
    end = min(rows.stop, ops.sk)  # causal: keys after the chunk's last row never count
    valid = _valid(topk_indices, rows.start, rows.stop, end, sparse)
    target = ops.attention_target(rows, end, valid, scale)
    if tp_group is not None:
        # each TP rank holds a slice of the heads: the target sums every head, as megatron all-reduces it
        torch.distributed.all_reduce(target, group=tp_group)
    target = target / target.sum(dim=-1, keepdim=True)
    per_head, w, index = ops.index_scores(rows, end)
    index = torch.softmax(index.masked_fill_(~valid, float("-inf")), dim=-1)
    return target, index, per_head, w, valid


def _tp(tp_group):
    """The group to all-reduce the target over, or None when there is nothing to reduce."""
    if tp_group is None or not torch.distributed.is_initialized():
        return None
    return tp_group if torch.distributed.get_world_size(tp_group) > 1 else None


def indexer_kl_loss_value(
    q, weights, k, query, key, topk_indices, softmax_scale: float, loss_coeff: float, sparse_loss: bool = False,
    *, tp_group=None, chunk_budget_elements: int = CHUNK_BUDGET_ELEMENTS,
) -> torch.Tensor:  # fmt: skip
    """The loss (fp32 scalar) that ``compute_dsa_indexer_loss`` returns, without building a graph."""
    _check(q, weights, k, query, key, topk_indices)
    tp_group = _tp(tp_group)
    with torch.no_grad():
        ops = _Operands(q, weights, k, query, key)
        chunk = _chunk_rows(ops.sq, ops.sk, ops.b, ops.attn_heads + ops.heads, chunk_budget_elements)
        total = torch.zeros((), dtype=torch.float32, device=q.device)
        for start in range(0, ops.sq, chunk):
            rows = slice(start, min(start + chunk, ops.sq))
            target, index, *_ = _target_and_index(ops, topk_indices, softmax_scale, sparse_loss, tp_group, rows)
            total += (target * (torch.log(target + EPS) - torch.log(index + EPS))).sum()
        return total / (ops.b * ops.sq) * loss_coeff


def indexer_kl_loss_grads(
    q, weights, k, query, key, topk_indices, softmax_scale: float, loss_coeff: float, sparse_loss: bool,
    grad_loss: torch.Tensor, *, tp_group=None, chunk_budget_elements: int = CHUNK_BUDGET_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dweights, dk) in q's, weights' and k's dtypes: ``bwd_fused_indexer_loss_naive``'s result."""
    _check(q, weights, k, query, key, topk_indices)
    tp_group = _tp(tp_group)
    with torch.no_grad():
        ops = _Operands(q, weights, k, query, key)
        b, sq, heads, dim = ops.b, ops.sq, ops.heads, ops.dim
        chunk = _chunk_rows(sq, ops.sk, b, ops.attn_heads + heads, chunk_budget_elements)
        per_row = torch.as_tensor(grad_loss, dtype=torch.float32, device=q.device) * loss_coeff / (b * sq)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dw = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
        dk = torch.zeros(b, ops.sk, dim, dtype=torch.float32, device=k.device)  # every later chunk adds to a key
        for start in range(0, sq, chunk):
            rows = slice(start, min(start + chunk, sq))
            n, end = rows.stop - rows.start, min(rows.stop, ops.sk)
            target, index, per_head, w, valid = _target_and_index(
                ops, topk_indices, softmax_scale, sparse_loss, tp_group, rows
            )
            # d loss / d softmax(i), then through the softmax; megatron's exact expression (its 1e-10 included)
            d_index = target.div_(index + EPS).mul_(-per_row)
            d_logits = index * (d_index - (d_index * index).sum(dim=-1, keepdim=True))
            d_logits.masked_fill_(~valid, 0.0)
            d_logits = d_logits.unsqueeze(2)  # [b, rows, 1, end]: one gradient per key, shared by the heads
            dw[rows] = (d_logits * per_head.relu()).sum(-1).permute(1, 0, 2).to(dw.dtype)
            d_scores = (d_logits * w.unsqueeze(-1)).mul_(per_head > 0).view(b, n * heads, end)
            dq[rows] = (
                torch.bmm(d_scores, ops.k32[:, :, :end].transpose(1, 2)).view(b, n, heads, dim).permute(1, 0, 2, 3)
            )
            dk[:, :end] += torch.bmm(d_scores.transpose(1, 2), ops.indexer_query(rows))
        return dq, dw, dk.permute(1, 0, 2).to(k.dtype)


class _IndexerKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, weights, k, query, key, topk_indices, scale, coeff, sparse, tp_group, budget):
        ctx.save_for_backward(q, weights, k, query, key, topk_indices)
        ctx.options = (scale, coeff, sparse, tp_group, budget)
        return indexer_kl_loss_value(
            q,
            weights,
            k,
            query,
            key,
            topk_indices,
            scale,
            coeff,
            sparse,
            tp_group=tp_group,
            chunk_budget_elements=budget,
        )

    @staticmethod
    def backward(ctx, grad_loss):
        scale, coeff, sparse, tp_group, budget = ctx.options
        dq, dw, dk = indexer_kl_loss_grads(
            *ctx.saved_tensors, scale, coeff, sparse, grad_loss, tp_group=tp_group, chunk_budget_elements=budget
        )
        return dq, dw, dk, *(None,) * 8


def indexer_kl_loss(
    q, weights, k, query, key, topk_indices, softmax_scale: float, loss_coeff: float, sparse_loss: bool = False,
    *, tp_group=None, chunk_budget_elements: int = CHUNK_BUDGET_ELEMENTS,
) -> torch.Tensor:  # fmt: skip
    """The indexer KL loss (fp32 scalar), differentiable w.r.t. q, weights and k (see the module docstring)."""
    return _IndexerKLLoss.apply(
        q, weights, k, query, key, topk_indices, float(softmax_scale), float(loss_coeff), bool(sparse_loss),
        tp_group, int(chunk_budget_elements),
    )  # fmt: skip
