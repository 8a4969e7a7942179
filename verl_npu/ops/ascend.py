"""Adapters from verl_npu's op contracts to torch_npu's fused operators (NPU tensors only).

Each adapter takes the arguments of the op it serves (see verl_npu.ops.dispatch), puts them in the
operator's form (BSND layout, contiguous, int32 indices, rope channels split from the head dim,
one dtype), calls the operator and converts the result back, so the caller gets the portable
backend's result. Before touching torch_npu each one checks the operator's documented input rules
and raises ``OperatorUnfit`` naming the offending value and the form that would fit; the
dispatcher then runs the portable backend instead.

Sources for the operators' contracts (learned from, not copied):
- torch_npu signatures and autograd: Ascend/op-plugin ``op_plugin/config/op_plugin_functions.yaml``
  and ``derivatives.yaml`` (commit 517f2e7, 2026-08): ``npu_sparse_flash_attention`` is
  differentiable through ``npu_sparse_flash_attention_grad``, which reads the forward's
  softmax_max/softmax_sum, so training calls need ``return_softmax_lse=True``;
  ``npu_lightning_indexer``'s indices are not differentiable.
- op-plugin ``docs/context/torch_npu-npu_{rms_norm,lightning_indexer,sparse_flash_attention,
  sparse_lightning_indexer_grad_kl_loss}.md`` and the shapes in ``op_plugin/python/meta/_meta_registrations.py``.
- the CANN kernels' host-side checks (ops-transformer ``attention/lightning_indexer/op_host/
  lightning_indexer_tiling.cpp``) and ``aclnnSparseLightningIndexerGradKLLoss.md`` (its spec table).
- how MindSpeed calls them for DSA (Ascend/MindSpeed ``dsa_npu_fused.py``): BSND from megatron's
  SBND, indices int32 with a key-head axis, ``attention_mode=2``, the latent key passed as key and value.
Facts no source confirmed are marked UNCONFIRMED below; tests_npu/ops/test_ops_npu.py checks them on an NPU.
"""

from __future__ import annotations

import torch

from verl_npu.contracts.torch_npu import INDEXER_SPARSE_COUNTS
from verl_npu.ops.fused_dsa_rules import (
    INDEXER_HEAD_DIM,
    INDEXER_MAX_HEADS,
    INDEXER_SMALL_TOPK,
    KL_INDEXER_HEADS,
    KL_MAX_TOPK,
    KL_QUERY_HEADS,
    KL_TOPK_STEP,
    LATENT_DIM,
    ROPE_DIM,
    SFA_QUERY_HEADS,
)

LOW_PRECISION = (torch.bfloat16, torch.float16)


class OperatorUnfit(ValueError):
    """The torch_npu operator cannot take these inputs; raised before it is called."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise OperatorUnfit(message)


def _same_low_precision(op: str, **tensors: torch.Tensor) -> torch.dtype:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    _require(
        first in LOW_PRECISION and all(d == first for d in dtypes.values()),
        f"{op} takes bfloat16 or float16 inputs of one dtype; got {', '.join(f'{n}={d}' for n, d in dtypes.items())}",
    )
    return first


def _square_causal(op: str, sq: int, skv: int) -> None:
    # sparse_mode=3 is "rightDownCausal": the diagonal is anchored at the bottom-right corner, which is
    # megatron's top-left causal mask (key j <= query i) only when both lengths agree
    _require(
        sq == skv,
        f"{op}'s causal mode is anchored bottom-right, megatron's mask top-left: they agree only for sq == skv; "
        f"got sq={sq}, skv={skv}",
    )


# --- RMSNorm -----------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """dispatch.rms_norm through ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``; gamma must be in x's dtype."""
    import torch_npu

    if residual is not None:
        x = x + residual
    y = torch_npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]
    return (y, x) if residual is not None else y


# --- DSA indexer top-k -------------------------------------------------------------------------


def lightning_indexer_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, causal: bool = True):
    """dispatch.dsa_indexer_topk through ``npu_lightning_indexer``: [b, sq, min(topk, skv)] int64 key indices.

    q [sq, b, h, d], k [skv, b, d], weights [sq, b, h]. The operator takes q/k/weights of one
    low-precision dtype (weights are cast to q's, as megatron's already are), head dim 128, one
    key head and 1..2048 keys per row; it returns int32 [b, sq, 1, count], best first, rows with
    fewer causal keys than ``count`` padded with -1 after them.
    """
    sq, _, heads, dim = q.shape
    skv = k.shape[0]
    keep = min(topk, skv)
    # short rows: ask for the configured top-k, which the operator pads with -1, and keep the first `keep`
    count = keep if keep <= INDEXER_SMALL_TOPK else topk
    op = "npu_lightning_indexer"
    _same_low_precision(op, q=q, k=k)
    _require(dim == INDEXER_HEAD_DIM, f"{op} takes index head dim {INDEXER_HEAD_DIM}; got q {tuple(q.shape)}")
    _require(1 <= heads <= INDEXER_MAX_HEADS, f"{op} takes 1..{INDEXER_MAX_HEADS} index heads; got {heads}")
    _require(
        count in INDEXER_SPARSE_COUNTS,
        f"{op} keeps 1..{INDEXER_SMALL_TOPK} keys per row, or a multiple of 1024 up to 8192; asked for {count}",
    )
    if causal:
        _square_causal(op, sq, skv)
    import torch_npu

    with torch.no_grad():  # indices only: the operator's autograd would track the unused values output
        indices, _ = torch_npu.npu_lightning_indexer(
            q.permute(1, 0, 2, 3).contiguous(),
            k.permute(1, 0, 2).unsqueeze(2).contiguous(),
            weights.to(q.dtype).permute(1, 0, 2).contiguous(),
            layout_query="BSND",
            layout_key="BSND",
            sparse_count=count,
            sparse_mode=3 if causal else 0,
        )
    indices = indices.squeeze(2)[..., :keep].long()
    if causal:
        # a -1 (the kernel's fill for missing keys, ops-transformer lightning_indexer_service_vector.h)
        # pads a row that has fewer causal keys than `keep`, all of which it selected, its own
        # position included: that position stands in for the padding (a duplicate counts once), so
        # the result keeps megatron's contract of in-range indices
        rows = torch.arange(sq, device=indices.device).view(1, sq, 1)
        indices = torch.where(indices < 0, rows, indices)
    return indices


# --- DSA sparse attention ----------------------------------------------------------------------


def sparse_indices(topk_indices: torch.Tensor, skv: int, width: int | None = None) -> torch.Tensor:
    """[b, sq, 1, width or topk] int32 in the operators' form: each row's distinct causal keys first, -1 after.

    Our contract lets the top-k hold duplicates and keys after the query (both ignored). The
    operators want valid entries first (documented); UNCONFIRMED whether they would count a repeated
    index twice or mask a later key themselves: removing both is right either way.
    """
    idx = topk_indices.long()
    rows = torch.arange(idx.shape[1], device=idx.device).view(1, -1, 1)
    idx = torch.where((idx >= 0) & (idx <= rows) & (idx < skv), idx, skv).sort(dim=-1).values
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = idx.masked_fill(repeat, skv).sort(dim=-1).values
    if width is not None and width > idx.shape[-1]:
        idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]), value=skv)
    return idx.masked_fill(idx == skv, -1).to(torch.int32).unsqueeze(2).contiguous()


def _check_absorbed(op: str, query: torch.Tensor, key: torch.Tensor) -> None:
    """Refuses anything but absorbed-MLA query/key: one shared key head, 512 latent + 64 rope channels."""
    kv_heads = key.shape[2]
    _require(
        kv_heads == 1,
        f"{op} is an MQA / absorbed-MLA operator: it takes one key head shared by every query head; got key "
        f"{tuple(key.shape)} with {kv_heads} heads. megatron's unabsorbed MLA gives per-head keys, which only the "
        f"portable backend takes; the fused path needs the latent key [skv, b, 1, {LATENT_DIM}+{ROPE_DIM}] "
        f"(MindSpeed's use_dsa_absorb)",
    )
    _require(
        query.shape[3] == key.shape[3] == LATENT_DIM + ROPE_DIM,
        f"{op} takes query/key head dim {LATENT_DIM} (latent) + {ROPE_DIM} (rope) = {LATENT_DIM + ROPE_DIM}; "
        f"got query {tuple(query.shape)}, key {tuple(key.shape)}",
    )


def _absorbed_parts(query: torch.Tensor, key: torch.Tensor):
    """(q_nope, q_rope, k_nope, k_rope): BSND, contiguous (the operators take no strided inputs)."""
    q, kk = query.permute(1, 0, 2, 3), key.permute(1, 0, 2, 3)
    parts = (q[..., :LATENT_DIM], q[..., LATENT_DIM:], kk[..., :LATENT_DIM], kk[..., LATENT_DIM:])
    return tuple(t.contiguous() for t in parts)


def _is_latent_values(value: torch.Tensor, key: torch.Tensor) -> bool:
    """value holds the latent values [skv, b, 1, 512] (absorbed MLA: the key's latent channels) in key's dtype.

    The operator takes key and value as two tensors; they need not share memory.
    """
    return value.shape == (*key.shape[:3], LATENT_DIM) and value.dtype == key.dtype


def sparse_flash_attention(query, key, value, topk_indices, softmax_scale: float) -> torch.Tensor:
    """dispatch.dsa_sparse_attention through ``npu_sparse_flash_attention`` (absorbed MLA, attention_mode=2).

    Takes the MQA form only: query [sq, b, np, 576], key [skv, b, 1, 576] (512 latent channels then
    64 rope channels), value [skv, b, 1, 512] (the latent values: key[..., :512] in absorbed MLA, in
    memory of its own or not), np in 1, 2, 4, ..., 128, sq == skv. Returns [sq, b, np * 512] in
    query's dtype. Differentiable: torch_npu registers npu_sparse_flash_attention_grad, fed by the
    softmax statistics this call asks for whenever a gradient is needed.
    """
    op = "npu_sparse_flash_attention"
    sq, b, heads, _ = query.shape
    skv = key.shape[0]
    _same_low_precision(op, query=query, key=key, value=value)
    _require(heads in SFA_QUERY_HEADS, f"{op} takes {SFA_QUERY_HEADS} query heads; got {heads}")
    _check_absorbed(op, query, key)
    _require(
        _is_latent_values(value, key),
        f"{op} takes the latent values [skv, b, 1, {LATENT_DIM}] in key's dtype as value; got value "
        f"{tuple(value.shape)} {value.dtype}",
    )
    _require(
        topk_indices.shape[:2] == (b, sq), f"topk_indices {tuple(topk_indices.shape)}: expected [b={b}, sq={sq}, topk]"
    )
    _square_causal(op, sq, skv)
    import torch_npu

    q_nope, q_rope, k_nope, k_rope = _absorbed_parts(query, key)
    lengths = torch.full((b,), sq, dtype=torch.int32, device=query.device)
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    values = value.permute(1, 0, 2, 3).contiguous()
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_nope, k_nope, values, sparse_indices(topk_indices, skv), float(softmax_scale),
        actual_seq_lengths_query=lengths, actual_seq_lengths_kv=lengths, query_rope=q_rope, key_rope=k_rope,
        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3, attention_mode=2,
        return_softmax_lse=needs_grad,
    )  # fmt: skip
    return out.permute(1, 0, 2, 3).reshape(sq, b, heads * LATENT_DIM)


# --- DSA indexer KL loss -----------------------------------------------------------------------


class _FusedIndexerKLLoss(torch.autograd.Function):
    """The operator returns the loss and its gradients in one call; backward only scales them."""

    @staticmethod
    def forward(ctx, q, weights, k, query, key, topk_indices, scale, coeff):
        import torch_npu

        sq, b = q.shape[:2]
        q_nope, q_rope, k_nope, k_rope = _absorbed_parts(query, key)
        # the operator takes a multiple of 1024 keys per row: shorter top-k sets are padded with -1
        width = -(-topk_indices.shape[-1] // KL_TOPK_STEP) * KL_TOPK_STEP
        indices = sparse_indices(topk_indices, key.shape[0], width)
        lengths = torch.full((b,), sq, dtype=torch.int32, device=q.device)
        # the loss's target is the main attention's softmax over the selected keys: its statistics
        # come from the sparse attention operator, as in MindSpeed's fused DSA
        _, softmax_max, softmax_sum = torch_npu.npu_sparse_flash_attention(
            q_nope, k_nope, k_nope, indices, scale, actual_seq_lengths_query=lengths, actual_seq_lengths_kv=lengths,
            query_rope=q_rope, key_rope=k_rope, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
            sparse_mode=3, attention_mode=2, return_softmax_lse=True,
        )  # fmt: skip
        d_q, d_k, d_weights, loss = torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
            q_nope, k_nope, q.permute(1, 0, 2, 3).contiguous(), k.permute(1, 0, 2).unsqueeze(2).contiguous(),
            weights.to(q.dtype).permute(1, 0, 2).contiguous(), indices, softmax_max, softmax_sum, scale,
            query_rope=q_rope, key_rope=k_rope, layout="BSND", sparse_mode=3,
        )  # fmt: skip
        # the operator sums the KL over the b * sq rows (as MindSpeed and torchtitan-npu normalise it);
        # megatron averages and multiplies by the coefficient. UNCONFIRMED: whether it adds megatron's
        # 1e-10 inside the logs (the two differ where softmax(I) on a selected key is below ~1e-6)
        per_row = coeff / (b * sq)
        ctx.save_for_backward(d_q, d_k, d_weights)
        ctx.per_row, ctx.dtypes = per_row, (q.dtype, k.dtype, weights.dtype)
        return loss.reshape(()).float() * per_row

    @staticmethod
    def backward(ctx, grad_loss):
        d_q, d_k, d_weights = ctx.saved_tensors
        q_dtype, k_dtype, w_dtype = ctx.dtypes
        scale = grad_loss.float() * ctx.per_row
        return (
            (d_q.float() * scale).permute(1, 0, 2, 3).to(q_dtype),
            (d_weights.float() * scale).permute(1, 0, 2).to(w_dtype),
            (d_k.float().squeeze(2) * scale).permute(1, 0, 2).to(k_dtype),
            *(None,) * 5,
        )


def indexer_kl_loss(
    q, weights, k, query, key, topk_indices, softmax_scale: float, loss_coeff: float, sparse_loss: bool = False,
    *, tp_group=None,
) -> torch.Tensor:  # fmt: skip
    """dispatch.dsa_indexer_loss through ``npu_sparse_lightning_indexer_grad_kl_loss``.

    The operator computes the sparse loss (megatron's ``dsa_indexer_use_sparse_loss=True``): its target is the
    main attention over the selected keys, read from npu_sparse_flash_attention's softmax statistics, so it
    takes the absorbed-MLA form only (see sparse_flash_attention), N1 in 32, 64, 128, 8..64 indexer heads of
    dim 128, one device's heads (the target's head sum is not reduced across tensor-parallel ranks), and up
    to 8192 keys per row (padded with -1 to the multiple of 1024 it takes).
    """
    op = "npu_sparse_lightning_indexer_grad_kl_loss"
    sq, _, heads, dim = q.shape
    _require(
        sparse_loss,
        f"{op} computes the sparse (top-k) loss only; dsa_indexer_use_sparse_loss=False needs the dense one",
    )
    _require(
        tp_group is None,
        f"{op} sums the attention heads of one device; with tensor parallelism the target needs every rank's heads",
    )
    _same_low_precision(op, q=q, k=k, query=query, key=key)
    _require(weights.dtype in LOW_PRECISION, f"{op} takes bfloat16 or float16 weights; got {weights.dtype}")
    _require(query.shape[2] in KL_QUERY_HEADS, f"{op} takes {KL_QUERY_HEADS} attention heads; got {query.shape[2]}")
    _require(heads in KL_INDEXER_HEADS, f"{op} takes {KL_INDEXER_HEADS} indexer heads; got {heads}")
    _require(
        topk_indices.shape[-1] <= KL_MAX_TOPK,
        f"{op} takes up to {KL_MAX_TOPK} keys per row; got a top-k of {topk_indices.shape[-1]}",
    )
    # UNCONFIRMED as a hard limit: the operator's spec lists 128 as the indexer head dim's typical value
    _require(dim == INDEXER_HEAD_DIM, f"{op} is specified for indexer head dim {INDEXER_HEAD_DIM}; got {dim}")
    _check_absorbed(op, query, key)
    _square_causal(op, sq, key.shape[0])
    return _FusedIndexerKLLoss.apply(q, weights, k, query, key, topk_indices, float(softmax_scale), float(loss_coeff))
