"""DSA sparse attention with one shared key/value head (MQA / absorbed MLA): Triton gather kernels.

Same contract as the portable ``verl_npu.ops.dsa_attention.sparse_attention`` (megatron-core 0.18's
``unfused_dsa_fn`` layouts: query ``[sq, b, np, hn]``, key ``[skv, b, 1, hn]``, value
``[skv, b, 1, hnv]``, topk_indices ``[b, sq, topk]`` shared by all heads; causal; duplicates count
once; out-of-range and -1 entries ignored; a query without a valid key outputs 0 with zero
gradients; the result is ``[sq, b, np * hnv]`` in value's dtype, softmax in fp32), restricted to
key/value with ONE head, the absorbed-MLA form GLM-5 / DeepSeek-V3.2 run (np = 64, hn = 576 =
kv_lora_rank 512 + rope 64, hnv = 512, value = key[..., :512]). Per-head keys are refused: the
tiled Triton kernel (``dsa_attention_triton``) or the portable backend serve those.

Why a gather kernel: every query head shares the key head, so per query token the selected key
rows are gathered once and multiplied against all of the token's heads as one real matrix product
(``[heads, hn] x [hn, BLOCK_N]`` on tensor cores, heads as the M dimension). Work is
O(s * topk * np * (hn + hnv)), not the O(s^2) of dense masked attention over the causal prefix.

Design:
- Pre-pass (torch): each row's indices are made invalid (-1) where negative, out of range or after
  the query; sorted ascending (gathers walk the key cache in address order, and the valid entries
  come first so a row's loop stops at its count); repeats of the previous entry become -1 holes.
  int32, ``[b, sq, topk]`` plus a ``[b, sq]`` count of non-sentinel entries.
- Forward: a program per (query token, batch, block of BLOCK_H heads) walks the row's indices
  BLOCK_N at a time, gathers those key rows, scores them with tl.dot and keeps an fp32 online
  softmax and ``[BLOCK_H, hnv]`` accumulator; writes the output and the fp32 log-sum-exp (base 2).
  hn = 576 is not a power of two, so the head dim is two power-of-two pieces: the largest power of
  two <= hn (512) and the rest padded to a power of two (64); both feed the same score tile.
  When value is the leading 512 channels of key (absorbed MLA), the gathered first key piece IS
  the value tile: it is loaded once and used for both products.
- Backward: ``delta = rowsum(dO * O)`` (torch); one fused program per (token, batch, head block)
  recomputes P from the log-sum-exp, accumulates dQ in registers, and scatters each key block's
  dK (``dS^T Q``) and dV (``P^T dO``) partial sums into fp32 ``[skv, b, d]`` buffers with
  ``tl.atomic_add``, cast at the end. Atomics are the one construct here outside the subset
  triton-ascend compiles cheaply; they are needed because a key row is selected by an arbitrary,
  data-dependent set of queries (and head blocks), so no program owns a key row: the alternative,
  inverting the index lists and re-gathering queries per key, turns every product into a
  matrix-vector one. When value is a view of key in autograd (value = key[..., :512], or both
  views of one tensor), dV is added into dK's first channels in the kernel (one atomic per element
  instead of two) and value's gradient is returned as None: the sum reaching the shared tensor is
  the same.

Memory: the sorted indices O(s * topk) int32 (kept for backward), the log-sum-exp O(s * np) and the
dK/dV buffers O(skv * d) fp32; no score matrix is ever stored.

When it applies: CUDA (and the Triton interpreter on CPU, for tests) with a single key/value head;
it is worth it wherever topk << s (at 16k tokens with topk 2048 it does an eighth of the causal
work). Ascend runs ``npu_sparse_flash_attention`` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verl_npu.ops.triton_support import (
    TRITON_DTYPES,
    check_attention_layout,
    interpreted,
    precision,
    refuse_if_deterministic,
    unit_last_stride,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """tl.dot; under the interpreter in fp32, whose 16-bit dot multiplies the raw bit patterns (Triton 3.6).
    bf16 x bf16 products are exact in fp32, so only the summation order differs from the tensor cores."""
    if INTERPRETED:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _mask(rows_ok, cols, LIMIT: tl.constexpr, END: tl.constexpr):
    """rows_ok[:, None] & (cols < LIMIT)[None, :] for a head-dim piece ending at END. A piece that ends
    within LIMIT keeps a row-only mask: a column test blocks vectorised (16-byte) loads and atomics."""
    return rows_ok[:, None] if END <= LIMIT else rows_ok[:, None] & (cols < LIMIT)[None, :]


@triton.jit
def _load_keys(K, V, k_rows, v_rows, valid, d_a, d_b, d_v, HN: tl.constexpr, HNV: tl.constexpr,
               DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr, HAS_B: tl.constexpr,
               V_FROM_K: tl.constexpr):  # fmt: skip
    """Gather BLOCK_N key rows (two head-dim pieces) and their value rows; invalid rows read as 0."""
    k_a = tl.load(K + k_rows[:, None] + d_a[None, :], mask=_mask(valid, d_a, HN, DA), other=0.0)
    # without a second piece k_b is a stand-in the callers never use
    k_b = tl.load(K + k_rows[:, None] + d_b[None, :], mask=_mask(valid, d_b, HN, DA + DB), other=0.0) if HAS_B else k_a
    # V_FROM_K: value is key's first piece, the same memory: one gather serves both
    v = k_a if V_FROM_K else tl.load(V + v_rows[:, None] + d_v[None, :], mask=_mask(valid, d_v, HNV, DV), other=0.0)
    return k_a, k_b, v


@triton.jit
def _forward(
    Q, K, V, IDX, COUNT, OUT, LSE,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_vs, stride_vb,
    sq, batch, heads, scale_log2,
    HN: tl.constexpr, HNV: tl.constexpr, TOPK: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    HAS_B: tl.constexpr, V_FROM_K: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # the last queries have the most valid keys: start them first so the tail of the grid is short
    i = (sq - 1 - pid // HEAD_BLOCKS).to(tl.int64)
    bb = tl.program_id(1).to(tl.int64)
    h = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads  # heads are padded to BLOCK_H (>= 16 rows for tensor cores)
    d_a = tl.arange(0, DA)
    d_b = DA + tl.arange(0, DB)
    d_v = tl.arange(0, DV)
    q_rows = i * stride_qs + bb * stride_qb + h * stride_qh
    q_a = tl.load(Q + q_rows[:, None] + d_a[None, :], mask=_mask(h_ok, d_a, HN, DA), other=0.0)
    if HAS_B:
        q_b = tl.load(Q + q_rows[:, None] + d_b[None, :], mask=_mask(h_ok, d_b, HN, DA + DB), other=0.0)
    row = (bb * sq + i) * TOPK
    count = tl.load(COUNT + bb * sq + i)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    # the interpreter cannot take a loaded value (nor any assigned variable: it makes every assignment a
    # tensor) as a loop bound: there the loop runs all TOPK slots and the count mask does the work;
    # compiled, each row stops after its own valid entries
    for start in range(0, TOPK if INTERPRETED else count, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        j = tl.load(IDX + row + n, mask=n < count, other=-1)
        valid = j >= 0
        key_rows = tl.where(valid, j, 0).to(tl.int64)
        k_a, k_b, v = _load_keys(K + bb * stride_kb, V + bb * stride_vb, key_rows * stride_ks, key_rows * stride_vs,
                                 valid, d_a, d_b, d_v, HN, HNV, DA, DB, DV, HAS_B, V_FROM_K)  # fmt: skip
        s = _mm(q_a, tl.trans(k_a), PRECISION, INTERPRETED)
        if HAS_B:
            s += _mm(q_b, tl.trans(k_b), PRECISION, INTERPRETED)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # a block of holes keeps m at -inf: shift by 0 there so no inf - inf appears
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PRECISION, INTERPRETED)
        m = m_new
    has_key = denom > 0
    out = acc / tl.where(has_key, denom, 1.0)[:, None]
    o_rows = ((i * batch + bb) * heads + h) * HNV
    o_mask = _mask(h_ok, d_v, HNV, DV)
    tl.store(OUT + o_rows[:, None] + d_v[None, :], out.to(OUT.dtype.element_ty), mask=o_mask)
    # +inf for a query without keys: backward's exp2(s - lse) is then 0, never inf - inf
    lse = tl.where(has_key, m + tl.log2(tl.where(has_key, denom, 1.0)), float("inf"))
    tl.store(LSE + (i * batch + bb) * heads + h, lse, mask=h_ok)


@triton.jit
def _backward(
    Q, K, V, IDX, COUNT, DO, LSE, DELTA, DQ, DK, DV,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_vs, stride_vb,
    sq, batch, heads, scale, scale_log2,
    HN: tl.constexpr, HNV: tl.constexpr, TOPK: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DV_: tl.constexpr,
    HAS_B: tl.constexpr, V_FROM_K: tl.constexpr, MERGE_DV: tl.constexpr, INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i = (sq - 1 - pid // HEAD_BLOCKS).to(tl.int64)
    bb = tl.program_id(1).to(tl.int64)
    h = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    d_a = tl.arange(0, DA)
    d_b = DA + tl.arange(0, DB)
    d_v = tl.arange(0, DV_)
    q_rows = i * stride_qs + bb * stride_qb + h * stride_qh
    q_a = tl.load(Q + q_rows[:, None] + d_a[None, :], mask=_mask(h_ok, d_a, HN, DA), other=0.0)
    if HAS_B:
        q_b = tl.load(Q + q_rows[:, None] + d_b[None, :], mask=_mask(h_ok, d_b, HN, DA + DB), other=0.0)
    token_heads = (i * batch + bb) * heads + h
    do = tl.load(DO + (token_heads * HNV)[:, None] + d_v[None, :], mask=_mask(h_ok, d_v, HNV, DV_), other=0.0)
    lse = tl.load(LSE + token_heads, mask=h_ok, other=float("inf"))
    delta = tl.load(DELTA + token_heads, mask=h_ok, other=0.0)
    dq_a = tl.zeros([BLOCK_H, DA], tl.float32)
    dq_b = tl.zeros([BLOCK_H, DB], tl.float32)
    row = (bb * sq + i) * TOPK
    count = tl.load(COUNT + bb * sq + i)
    for start in range(0, TOPK if INTERPRETED else count, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        j = tl.load(IDX + row + n, mask=n < count, other=-1)
        valid = j >= 0
        key_rows = tl.where(valid, j, 0).to(tl.int64)
        k_a, k_b, v = _load_keys(K + bb * stride_kb, V + bb * stride_vb, key_rows * stride_ks, key_rows * stride_vs,
                                 valid, d_a, d_b, d_v, HN, HNV, DA, DB, DV_, HAS_B, V_FROM_K)  # fmt: skip
        s = _mm(q_a, tl.trans(k_a), PRECISION, INTERPRETED)
        if HAS_B:
            s += _mm(q_b, tl.trans(k_b), PRECISION, INTERPRETED)
        p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), PRECISION, INTERPRETED)
        # gradient of the raw score q.k (softmax_scale folded in)
        ds = (p * (dp - delta[:, None]) * scale).to(k_a.dtype)
        dq_a += _mm(ds, k_a, PRECISION, INTERPRETED)
        if HAS_B:
            dq_b += _mm(ds, k_b, PRECISION, INTERPRETED)
        p_lp = p.to(do.dtype)
        # dK/dV rows: fp32 buffers [skv, b, d]; masked slots (holes, padding) add nothing
        dk_rows = (key_rows * batch + bb) * HN
        dk_a = _mm(tl.trans(ds), q_a, PRECISION, INTERPRETED)
        if MERGE_DV:
            dk_a += _mm(tl.trans(p_lp), do, PRECISION, INTERPRETED)
        else:
            dv = _mm(tl.trans(p_lp), do, PRECISION, INTERPRETED)
            dv_rows = (key_rows * batch + bb) * HNV
            tl.atomic_add(DV + dv_rows[:, None] + d_v[None, :], dv, mask=_mask(valid, d_v, HNV, DV_), sem="relaxed")
        tl.atomic_add(DK + dk_rows[:, None] + d_a[None, :], dk_a, mask=_mask(valid, d_a, HN, DA), sem="relaxed")
        if HAS_B:
            dk_b = _mm(tl.trans(ds), q_b, PRECISION, INTERPRETED)
            tl.atomic_add(DK + dk_rows[:, None] + d_b[None, :], dk_b, mask=_mask(valid, d_b, HN, DA + DB),
                          sem="relaxed")  # fmt: skip
    dq_rows = token_heads * HN
    tl.store(DQ + dq_rows[:, None] + d_a[None, :], dq_a.to(DQ.dtype.element_ty), mask=_mask(h_ok, d_a, HN, DA))
    if HAS_B:
        tl.store(DQ + dq_rows[:, None] + d_b[None, :], dq_b.to(DQ.dtype.element_ty), mask=_mask(h_ok, d_b, HN, DA + DB))


# Launch settings (BLOCK_H heads, BLOCK_N keys, warps, pipeline stages), swept on nvidia-h200 at
# s = 4096 (then checked at 16384), b = 1, 64 heads, hn 576, hnv 512, topk 2048, bf16; register spills
# and shared memory were screened first by compiling for sm_90a with Triton's ptxas on the CPU.
# Forward: 64 heads fill one wgmma M tile per warpgroup and gather each key block once per token;
# the [64, 512] fp32 accumulator spreads over 8 warps (128 registers a thread) while q and the
# double-buffered key blocks sit in shared memory (221 KB at 64 keys when value is key's prefix; a
# separate value tile doubles the blocks, so 32 keys then). Backward keeps a [BLOCK_H, 576] fp32 dQ
# and needs Q, dO and the key blocks in shared memory: 64 heads exceed the 227 KB, so it takes 32.
FORWARD_CONFIG = (64, 64, 8, 2)
FORWARD_CONFIG_SEPARATE_VALUE = (64, 32, 8, 2)
BACKWARD_CONFIG = (32, 32, 8, 2)
# fp32 inputs (tests, debugging) take twice the shared memory per element
FP32_CONFIG = (16, 16, 8, 1)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _head_dims(hn: int, hnv: int) -> tuple[int, int, int, bool]:
    """Head-dim pieces: DA = largest power of two <= hn (>= 16, tl.dot's minimum), DB the padded rest."""
    d_a = max(16, _pow2_floor(hn))
    rest = hn - d_a
    d_b = max(16, triton.next_power_of_2(max(rest, 1)))
    return d_a, d_b, max(16, triton.next_power_of_2(hnv)), rest > 0


def _config(config: tuple[int, int, int, int], dtype: torch.dtype, heads: int) -> tuple[int, int, int, int]:
    block_h, block_n, warps, stages = FP32_CONFIG if dtype == torch.float32 else config
    # fewer heads than a block: pad to the next power of two, at least 16 (tl.dot's minimum M)
    return min(block_h, max(16, triton.next_power_of_2(heads))), block_n, warps, stages


def _prepare_indices(topk_indices: torch.Tensor, sq: int, skv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted int32 rows, -1 where invalid or repeated; [b, sq] count of the leading non-sentinel slots."""
    big = torch.iinfo(torch.int32).max
    positions = torch.arange(sq, device=topk_indices.device).view(1, sq, 1)
    valid = (topk_indices >= 0) & (topk_indices < skv) & (topk_indices <= positions)
    idx = torch.where(valid, topk_indices, big).to(torch.int32).sort(dim=-1).values
    count = (idx != big).sum(-1, dtype=torch.int32)
    repeated = idx[..., 1:] == idx[..., :-1]
    idx[..., 1:].masked_fill_(repeated, -1)
    idx.masked_fill_(idx == big, -1)
    return idx.contiguous(), count.contiguous()


def _value_is_key_prefix(key: torch.Tensor, value: torch.Tensor, d_a: int) -> bool:
    """Value's rows are key's first d_a channels (absorbed MLA): the kernels reuse the key gather."""
    return (
        value.shape[-1] == d_a <= key.shape[-1]
        and value.data_ptr() == key.data_ptr()
        and value.stride()[:2] == key.stride()[:2]
        and value.stride(-1) == key.stride(-1) == 1
    )


def _gradient_reaches_key(key: torch.Tensor, value: torch.Tensor) -> bool:
    """value's gradient flows into the same tensor key's does (a view of key, or both views of one
    base), so adding dV into dK and returning None for value gives every upstream tensor the same sum."""
    base = value._base
    return base is not None and (base is key or base is key._base)


class _SparseAttentionMQA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, topk_indices, scale):
        sq, b, heads, hn = query.shape
        skv, hnv = key.shape[0], value.shape[-1]
        idx, count = _prepare_indices(topk_indices, sq, skv)
        d_a, d_b, d_v, has_b = _head_dims(hn, hnv)
        v_from_k = _value_is_key_prefix(key, value, d_a)
        config = FORWARD_CONFIG if v_from_k else FORWARD_CONFIG_SEPARATE_VALUE
        block_h, block_n, warps, stages = _config(config, query.dtype, heads)
        head_blocks = triton.cdiv(heads, block_h)
        # the result is returned whole (a returned view of a saved tensor would refuse in-place use
        # downstream); the kernel writes it through a [sq, b, heads, hnv] view
        result = torch.empty(sq, b, heads * hnv, dtype=value.dtype, device=value.device)
        out = result.view(sq, b, heads, hnv)
        lse = torch.empty(sq, b, heads, dtype=torch.float32, device=query.device)
        _forward[(sq * head_blocks, b)](
            query, key, value, idx, count, out, lse,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
            value.stride(0), value.stride(1),
            sq, b, heads, scale * _LOG2E,
            HN=hn, HNV=hnv, TOPK=idx.shape[-1], HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, BLOCK_N=block_n,
            DA=d_a, DB=d_b, DV=d_v, HAS_B=has_b, V_FROM_K=v_from_k, INTERPRETED=interpreted(),
            PRECISION=precision(query.dtype), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        ctx.save_for_backward(query, key, value, idx, count, result, lse)
        ctx.scale = scale
        ctx.v_from_k = v_from_k
        ctx.merge_dv = v_from_k and all(ctx.needs_input_grad[1:3]) and _gradient_reaches_key(key, value)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        refuse_if_deterministic("sparse_attention_mqa_triton backward (key/value gradients added with tl.atomic_add)")
        query, key, value, idx, count, result, lse = ctx.saved_tensors
        sq, b, heads, hn = query.shape
        skv, hnv = key.shape[0], value.shape[-1]
        out = result.view(sq, b, heads, hnv)
        d_a, d_b, d_v, has_b = _head_dims(hn, hnv)
        do = grad_out.reshape(sq, b, heads, hnv).contiguous()
        delta = (do.float() * out.float()).sum(-1)  # [sq, b, np]
        block_h, block_n, warps, stages = _config(BACKWARD_CONFIG, query.dtype, heads)
        head_blocks = triton.cdiv(heads, block_h)
        dq = torch.empty(sq, b, heads, hn, dtype=query.dtype, device=query.device)
        dk = torch.zeros(skv, b, hn, dtype=torch.float32, device=key.device)
        dv = dk if ctx.merge_dv else torch.zeros(skv, b, hnv, dtype=torch.float32, device=value.device)
        _backward[(sq * head_blocks, b)](
            query, key, value, idx, count, do, lse, delta, dq, dk, dv,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1),
            value.stride(0), value.stride(1),
            sq, b, heads, ctx.scale, ctx.scale * _LOG2E,
            HN=hn, HNV=hnv, TOPK=idx.shape[-1], HEAD_BLOCKS=head_blocks, BLOCK_H=block_h, BLOCK_N=block_n,
            DA=d_a, DB=d_b, DV_=d_v, HAS_B=has_b, V_FROM_K=ctx.v_from_k, MERGE_DV=ctx.merge_dv,
            INTERPRETED=interpreted(), PRECISION=precision(query.dtype), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        grad_key = dk.view(skv, b, 1, hn).to(key.dtype)
        grad_value = None if ctx.merge_dv else dv.view(skv, b, 1, hnv).to(value.dtype)
        return dq, grad_key, grad_value, None, None


def sparse_attention_mqa_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """``unfused_dsa_fn``'s result for one shared key/value head ([sq, b, np * hnv], value's dtype); differentiable."""
    check_attention_layout(query, key, value, topk_indices)
    sq, b, _, hn = query.shape
    skv = key.shape[0]
    if key.shape[2] != 1 or value.shape[2] != 1:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} have {key.shape[2]} heads: this kernel takes one "
            "shared key/value head (MQA / absorbed MLA); use the tiled Triton kernel (dsa_attention_triton) or the "
            "portable backend for per-head keys"
        )
    if key.shape != (skv, b, 1, hn) or value.shape[:3] != (skv, b, 1):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}: "
            f"expected [skv, b={b}, 1, {hn}] and [skv, b={b}, 1, hnv]"
        )
    if not query.dtype == key.dtype == value.dtype or query.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype}: expected one of bf16, fp16, fp32 for all"
        )
    if topk_indices.dtype.is_floating_point or topk_indices.dtype == torch.bool:
        raise ValueError(f"topk_indices must be integers, got {topk_indices.dtype}")
    if topk_indices.shape[-1] == 0:  # nothing selected: one padding slot gives every query its zero output
        topk_indices = topk_indices.new_full((b, sq, 1), -1)
    query, key, value = (unit_last_stride(t) for t in (query, key, value))
    return _SparseAttentionMQA.apply(query, key, value, topk_indices, float(softmax_scale))
