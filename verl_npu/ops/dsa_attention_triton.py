"""DSA sparse attention as Triton kernels, forward and backward (CUDA; the interpreter runs them on CPU for tests).

Computes what megatron-core 0.18's ``unfused_dsa_fn(query, key, value, topk_indices, softmax_scale)``
computes, with the portable backend's (``verl_npu.ops.dsa_attention``) contract and layouts: query
``[sq, b, np, hn]``, key ``[skv, b, np, hn]``, value ``[skv, b, np, hnv]``, topk_indices ``[b, sq,
topk]`` shared by all heads (duplicates count once; indices after the query position or outside
``[0, skv)``, such as -1 padding, are ignored), causal; returns ``[sq, b, np * hnv]`` in value's
dtype, softmax statistics in fp32, and a query row with no valid key gives 0. Key and value carry
one head per query head: one key head shared by every query head (MQA, MLA in its absorbed form) is
refused, the gather kernel of ``dsa_attention_mqa_triton`` serves it (verl_npu.ops.dispatch routes it there).

Design. The top-k sets become a selection bitmask ``[b, sq, ceil(skv / 32)]`` int32 (bit ``j % 32``
of word ``j // 32`` set when key ``j`` is selected and ``j <= i``), built in chunks of query rows from
the indices (sorted, de-duplicated, then OR-ed in by adding distinct bits), so no ``[sq, skv]``
bool or float tensor exists whole. From it, a tile-occupancy map ``[b, n_query_blocks,
n_key_blocks]`` says which (query block, key block) tiles hold any selected key; each kernel gets it
as per-block lists of the occupied tiles, so a program's loop runs over occupied tiles only and
stops at the causal end (tiles past it are empty), with unconditional loads the compiler can
pipeline. Forward is flash attention over those tiles: one program per (query block, batch * head),
online softmax in fp32, the tile's mask read from the bitmask (one word per row and 32 keys,
broadcast over those keys, then each key's bit); it keeps the output and the row log-sum-exp (fp32,
base 2) for backward. Backward is
the flash backward without atomics, so it stays in the Triton subset triton-ascend compiles: a
preprocess for ``delta = rowsum(dO * O)``, one kernel per key block for dK/dV (walking the query
blocks that select it) and one per query block for dQ.

Memory. Besides inputs and outputs: the bitmask (``b * sq * skv / 8`` bytes: 128 MiB at 32k, kept
for backward and smaller than the int64 indices it replaces), the occupancy lists (``b *
(s / block)^2`` int32) and the fp32 ``lse``/``delta`` (``b * np * sq``); never O(s^2) in fp32.

Why tiles, not gathers: a kernel that gathers each query's top-k keys loads ``topk * hn`` key values
per query and head with no reuse (the keys are per head, so one query's gather serves one dot
product row), and cannot use the tensor cores; 2k keys of 256 dims per query, head and direction is
terabytes of traffic at 32k. Tiles reuse every loaded key block across a block of queries on the
tensor cores, and the bitmask makes the skipped work exact; the cost is computing the masked-out
scores inside occupied tiles, which at DSA's densities (top-k 2048 of up to s keys) is cheaper than
the gather's memory traffic.

Measured on nvidia-h200 (GLM-5 shapes: 64 heads, hn = hnv = 256, top-k 2048, bf16, b = 1;
bench/results/kernels_h200.json): with random causal top-k sets every causal tile is occupied and
forward + backward takes 10.1 ms at s = 4096 and 124 ms at 16384 (portable backend: 20.8 / 218 ms);
with a local window of 2048 keys most tiles are skipped: 34.6 ms at 16384.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from verl_npu.ops.triton_support import (
    TRITON_DTYPES,
    check_attention_layout,
    interpreted,
    precision,
    unit_last_stride,
)

_LOG2E = math.log2(math.e)

# Launch settings (BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages), swept on nvidia-h200 at
# GLM-5's shapes (64 heads, hn = hnv = 256, topk 2048 of causally masked random scores, bf16, s = 4096,
# b = 1) among the candidates that fit sm_90's shared memory without heavy register spills; the fastest
# of each kernel was kept. BLOCK_N is a multiple of 32 (whole bitmask words).
FORWARD_CONFIG = (128, 64, 8, 2)
BACKWARD_KV_CONFIG = (64, 32, 4, 2)
BACKWARD_Q_CONFIG = (128, 64, 8, 1)
# fp32 inputs: twice the tile bytes; the largest tiles that fit shared memory at hn = 256 (screened
# by compiling for sm_90: shared memory and spills); fp32 is the precise mode, not the fast one
FP32_FORWARD_CONFIG = (64, 32, 4, 2)
FP32_BACKWARD_KV_CONFIG = (32, 32, 4, 1)
FP32_BACKWARD_Q_CONFIG = (32, 32, 4, 2)
DELTA_CONFIG = (64, 4)  # (BLOCK_M, num_warps): one pass over O and dO
# the interpreter (CPU tests): small tiles, so odd test sizes span several query and key blocks
INTERPRETER_CONFIG = (16, 32, 1, 1)
# selection-bitmask construction: query rows per chunk are capped so that about this many index
# elements (a few int64 temporaries of [b, rows, topk]) exist at once
BITMASK_CHUNK_ELEMENTS = 2**24


@triton.jit
def _mm(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b with fp32 accumulation (see triton_support.interpreted for the widening)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_mask(bits_rows, rows_ok, key_block, n_words, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TRANSPOSED: tl.constexpr):  # fmt: skip
    """The tile's selected (query, key) pairs, [BLOCK_M, BLOCK_N] ([BLOCK_N, BLOCK_M] if TRANSPOSED).

    One word per (query row, 32 keys) is loaded and broadcast over its keys: a [BLOCK_M, BLOCK_N]
    gather of words would cost a 64-bit address per element and spill the registers at hn = 256.
    """
    cols = tl.arange(0, BLOCK_N)
    first = key_block * (BLOCK_N // 32)  # BLOCK_N is a multiple of 32: the tile starts on a word
    w = tl.load(bits_rows + first, mask=rows_ok & (first < n_words), other=0)
    if TRANSPOSED:
        word = tl.broadcast_to(w[None, :], [BLOCK_N, BLOCK_M])
    else:
        word = tl.broadcast_to(w[:, None], [BLOCK_M, BLOCK_N])
    for g in tl.static_range(1, BLOCK_N // 32):
        w = tl.load(bits_rows + first + g, mask=rows_ok & (first + g < n_words), other=0)
        if TRANSPOSED:
            word = tl.where((cols >> 5)[:, None] == g, w[None, :], word)
        else:
            word = tl.where((cols >> 5)[None, :] == g, w[:, None], word)
    shift = (cols & 31)[:, None] if TRANSPOSED else (cols & 31)[None, :]
    return ((word >> shift) & 1) != 0


@triton.jit
def _load_key_tile(k_base, v_base, key_block, skv, stride_ks, stride_vs, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):  # fmt: skip
    """Key block ``key_block``'s key [BLOCK_N, BLOCK_D] and value [BLOCK_N, BLOCK_DV] rows; padding reads as 0."""
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < skv
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_ks + d[None, :],
                mask=key_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vs + dv[None, :],
                mask=key_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)  # fmt: skip
    return k, v


@triton.jit
def _forward_step(
    q, acc, m_i, l_i, key_block, k_base, v_base, bits_rows, rows_ok, skv, n_words, stride_ks, stride_vs, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    k, v = _load_key_tile(k_base, v_base, key_block, skv, stride_ks, stride_vs, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM,
                          HEAD_DIM_V)  # fmt: skip
    selected = _tile_mask(bits_rows, rows_ok, key_block, n_words, BLOCK_M, BLOCK_N, False)
    s = _mm(q, tl.trans(k), None, PRECISION, INTERPRETED) * scale_log2
    s = tl.where(selected, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with no selected key so far keeps m = -inf; shifting by 0 instead keeps exp2 free of NaN
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, INTERPRETED)
    return acc, m_new, l_i


@triton.jit
def _forward(
    Q, K, V, OUT, LSE, BITS, COUNTS, BLOCKS, sq, skv, heads, n_words, n_key_blocks,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh,
    stride_os, stride_ob, stride_oh, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    # the last query blocks have the most key tiles (causal): start them first
    query_block = tl.num_programs(0) - 1 - tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < sq
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + batch * stride_qb + head * stride_qh + rows[:, None].to(tl.int64) * stride_qs + d[None, :],
                mask=rows_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    bits_rows = BITS + (batch * sq + rows).to(tl.int64) * n_words
    tile_row = batch * tl.cdiv(sq, BLOCK_M) + query_block
    count = tl.load(COUNTS + tile_row)
    key_blocks = BLOCKS + tile_row.to(tl.int64) * n_key_blocks
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if INTERPRETED:  # see triton_support.interpreted
        t = count * 0
        while t < count:
            acc, m_i, l_i = _forward_step(q, acc, m_i, l_i, tl.load(key_blocks + t), k_base, v_base, bits_rows,
                                          rows_ok, skv, n_words, stride_ks, stride_vs, scale_log2, BLOCK_M, BLOCK_N,
                                          BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
            t += 1
    else:
        for t in range(0, count):
            acc, m_i, l_i = _forward_step(q, acc, m_i, l_i, tl.load(key_blocks + t), k_base, v_base, bits_rows,
                                          rows_ok, skv, n_words, stride_ks, stride_vs, scale_log2, BLOCK_M, BLOCK_N,
                                          BLOCK_D, BLOCK_DV, HEAD_DIM, HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
    # no selected key: output 0; lse = +inf (backward's mask zeroes the row anyway; exp2(s - inf) cannot overflow)
    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    tl.store(OUT + batch * stride_ob + head * stride_oh + rows[:, None].to(tl.int64) * stride_os + dv[None, :],
             out.to(OUT.dtype.element_ty), mask=rows_ok[:, None] & (dv[None, :] < HEAD_DIM_V))  # fmt: skip
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(LSE + batch_head.to(tl.int64) * sq + rows, lse, mask=rows_ok)


@triton.jit
def _delta(
    OUT, DO, DELTA, sq, heads, stride_os, stride_ob, stride_oh, stride_dos, stride_dob, stride_doh,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM_V: tl.constexpr,
):  # fmt: skip
    """delta_i = sum_d dO_i * O_i: the row term of the softmax backward, shared by both gradient kernels."""
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < sq
    dv = tl.arange(0, BLOCK_DV)
    mask = rows_ok[:, None] & (dv[None, :] < HEAD_DIM_V)
    o = tl.load(OUT + batch * stride_ob + head * stride_oh + rows[:, None].to(tl.int64) * stride_os + dv[None, :],
                mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None].to(tl.int64) * stride_dos + dv[None, :],
                 mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    tl.store(DELTA + batch_head.to(tl.int64) * sq + rows, tl.sum(o * do, 1), mask=rows_ok)


@triton.jit
def _backward_kv_step(
    k, v, dk, dv_acc, query_block, q_base, do_base, lse_base, delta_base, bits_base, key_block, sq, n_words,
    stride_qs, stride_dos, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < sq
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qs + d[None, :],
                mask=rows_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    do = tl.load(do_base + rows[:, None].to(tl.int64) * stride_dos + dv[None, :],
                 mask=rows_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)  # fmt: skip
    lse = tl.load(lse_base + rows, mask=rows_ok, other=float("inf"))
    delta = tl.load(delta_base + rows, mask=rows_ok, other=0.0)
    # transposed tile [keys, queries]: the products below then accumulate straight into dK/dV
    selected = _tile_mask(bits_base + rows.to(tl.int64) * n_words, rows_ok, key_block, n_words, BLOCK_M, BLOCK_N, True)
    s_t = _mm(k, tl.trans(q), None, PRECISION, INTERPRETED) * scale_log2
    p_t = tl.where(selected, tl.exp2(s_t - lse[None, :]), 0.0)
    dv_acc = _mm(p_t.to(do.dtype), do, dv_acc, PRECISION, INTERPRETED)
    dp_t = _mm(v, tl.trans(do), None, PRECISION, INTERPRETED)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _mm(ds_t.to(q.dtype), q, dk, PRECISION, INTERPRETED)
    return dk, dv_acc


@triton.jit
def _backward_kv(
    Q, K, V, DO, LSE, DELTA, DK, DV, BITS, COUNTS, BLOCKS, sq, skv, heads, n_words, n_query_blocks,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh,
    stride_dos, stride_dob, stride_doh, stride_dks, stride_dkb, stride_dkh, stride_dvs, stride_dvb, stride_dvh,
    scale, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """dK/dV of one key block of one (batch, head)."""
    key_block = tl.program_id(0)  # early key blocks are selected by the most query blocks: they start first
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < skv
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_mask = key_ok[:, None] & (d[None, :] < HEAD_DIM)
    v_mask = key_ok[:, None] & (dv[None, :] < HEAD_DIM_V)
    k = tl.load(K + batch * stride_kb + head * stride_kh + keys[:, None].to(tl.int64) * stride_ks + d[None, :],
                mask=k_mask, other=0.0)  # fmt: skip
    v = tl.load(V + batch * stride_vb + head * stride_vh + keys[:, None].to(tl.int64) * stride_vs + dv[None, :],
                mask=v_mask, other=0.0)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    bits_base = BITS + batch.to(tl.int64) * sq * n_words
    tile_row = batch * tl.cdiv(skv, BLOCK_N) + key_block
    count = tl.load(COUNTS + tile_row)
    query_blocks = BLOCKS + tile_row.to(tl.int64) * n_query_blocks
    q_base = Q + batch * stride_qb + head * stride_qh
    do_base = DO + batch * stride_dob + head * stride_doh
    lse_base = LSE + batch_head.to(tl.int64) * sq
    delta_base = DELTA + batch_head.to(tl.int64) * sq
    if INTERPRETED:  # see triton_support.interpreted
        t = count * 0
        while t < count:
            dk, dv_acc = _backward_kv_step(k, v, dk, dv_acc, tl.load(query_blocks + t), q_base, do_base, lse_base,
                                           delta_base, bits_base, key_block, sq, n_words, stride_qs,
                                           stride_dos, scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM,
                                           HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
            t += 1
    else:
        for t in range(0, count):
            dk, dv_acc = _backward_kv_step(k, v, dk, dv_acc, tl.load(query_blocks + t), q_base, do_base, lse_base,
                                           delta_base, bits_base, key_block, sq, n_words, stride_qs,
                                           stride_dos, scale_log2, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM,
                                           HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
    rows64 = keys[:, None].to(tl.int64)
    tl.store(DK + batch * stride_dkb + head * stride_dkh + rows64 * stride_dks + d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=k_mask)  # fmt: skip
    tl.store(DV + batch * stride_dvb + head * stride_dvh + rows64 * stride_dvs + dv[None, :],
             dv_acc.to(DV.dtype.element_ty), mask=v_mask)  # fmt: skip


@triton.jit
def _backward_q_step(
    q, do, lse, delta, dq, key_block, k_base, v_base, bits_rows, rows_ok, skv, n_words, stride_ks, stride_vs,
    scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    k, v = _load_key_tile(k_base, v_base, key_block, skv, stride_ks, stride_vs, BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_DIM,
                          HEAD_DIM_V)  # fmt: skip
    selected = _tile_mask(bits_rows, rows_ok, key_block, n_words, BLOCK_M, BLOCK_N, False)
    s = _mm(q, tl.trans(k), None, PRECISION, INTERPRETED) * scale_log2
    p = tl.where(selected, tl.exp2(s - lse[:, None]), 0.0)
    dp = _mm(do, tl.trans(v), None, PRECISION, INTERPRETED)
    ds = p * (dp - delta[:, None])
    return _mm(ds.to(k.dtype), k, dq, PRECISION, INTERPRETED)


@triton.jit
def _backward_q(
    Q, K, V, DO, LSE, DELTA, DQ, BITS, COUNTS, BLOCKS, sq, skv, heads, n_words, n_key_blocks,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh,
    stride_dos, stride_dob, stride_doh, stride_dqs, stride_dqb, stride_dqh, scale, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    query_block = tl.num_programs(0) - 1 - tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // heads
    head = batch_head % heads
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < sq
    rows64 = rows[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_mask = rows_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + batch * stride_qb + head * stride_qh + rows64 * stride_qs + d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows64 * stride_dos + dv[None, :],
                 mask=rows_ok[:, None] & (dv[None, :] < HEAD_DIM_V), other=0.0)  # fmt: skip
    lse = tl.load(LSE + batch_head.to(tl.int64) * sq + rows, mask=rows_ok, other=float("inf"))
    delta = tl.load(DELTA + batch_head.to(tl.int64) * sq + rows, mask=rows_ok, other=0.0)
    k_base = K + batch * stride_kb + head * stride_kh
    v_base = V + batch * stride_vb + head * stride_vh
    bits_rows = BITS + (batch * sq + rows).to(tl.int64) * n_words
    tile_row = batch * tl.cdiv(sq, BLOCK_M) + query_block
    count = tl.load(COUNTS + tile_row)
    key_blocks = BLOCKS + tile_row.to(tl.int64) * n_key_blocks
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if INTERPRETED:  # see triton_support.interpreted
        t = count * 0
        while t < count:
            dq = _backward_q_step(q, do, lse, delta, dq, tl.load(key_blocks + t), k_base, v_base, bits_rows, rows_ok,
                                  skv, n_words, stride_ks, stride_vs, scale_log2, BLOCK_M, BLOCK_N, BLOCK_D,
                                  BLOCK_DV, HEAD_DIM, HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
            t += 1
    else:
        for t in range(0, count):
            dq = _backward_q_step(q, do, lse, delta, dq, tl.load(key_blocks + t), k_base, v_base, bits_rows, rows_ok,
                                  skv, n_words, stride_ks, stride_vs, scale_log2, BLOCK_M, BLOCK_N, BLOCK_D,
                                  BLOCK_DV, HEAD_DIM, HEAD_DIM_V, PRECISION, INTERPRETED)  # fmt: skip
    tl.store(DQ + batch * stride_dqb + head * stride_dqh + rows64 * stride_dqs + d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)  # fmt: skip


def _selection_bits(topk_indices: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """[b, sq, ceil(skv / 32)] int32: bit j % 32 of word j // 32 set when key j is selected and j <= i."""
    b, _, topk = topk_indices.shape
    device = topk_indices.device
    bits = torch.zeros(b, sq, -(-skv // 32), dtype=torch.int32, device=device)
    rows = max(1, BITMASK_CHUNK_ELEMENTS // max(b * topk, 1))
    for start in range(0, sq, rows):
        stop = min(start + rows, sq)
        idx = topk_indices[:, start:stop].long()
        positions = torch.arange(start, stop, device=device).view(1, -1, 1)
        idx = torch.where((idx >= 0) & (idx < skv) & (idx <= positions), idx, -1).sort(dim=-1).values
        # sorted: a duplicate sits next to its first copy; adding distinct bits is an OR
        keep = idx >= 0
        keep[..., 1:] &= idx[..., 1:] != idx[..., :-1]
        bit = torch.bitwise_left_shift(torch.ones_like(idx), idx & 31)
        bit = torch.where(keep, bit - ((bit >> 31) << 32), 0)  # bit 31 becomes int32's sign bit, exactly
        bits[:, start:stop].scatter_add_(-1, idx.clamp(min=0) >> 5, bit.to(torch.int32))
    return bits


def _occupancy(bits: torch.Tensor, block_m: int, block_n: int, skv: int) -> torch.Tensor:
    """[b, n_query_blocks, n_key_blocks] bool: the tile holds at least one selected (query, key) pair."""
    b, sq, words = bits.shape
    per_block = block_n // 32
    n_qb, n_kb = -(-sq // block_m), -(-skv // block_n)
    occupied = torch.empty(b, n_qb, n_kb, dtype=torch.bool, device=bits.device)
    # query blocks per chunk, so the temporaries stay a few tens of MB whatever s is
    chunk = max(1, 2**24 // max(block_m * words * b, 1))
    for first in range(0, n_qb, chunk):
        last = min(first + chunk, n_qb)
        part = bits[:, first * block_m : last * block_m]
        part = torch.nn.functional.pad(part, (0, n_kb * per_block - words, 0, (last - first) * block_m - part.shape[1]))
        part = part.view(b, last - first, block_m, n_kb, per_block)
        occupied[:, first:last] = part.ne(0).any(dim=4).any(dim=2)
    return occupied


def _tile_lists(occupied: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the map: how many tiles are occupied, and their column indices first, ascending."""
    counts = occupied.sum(-1, dtype=torch.int32)
    order = torch.argsort((~occupied).to(torch.uint8), dim=-1, stable=True)
    return counts.contiguous(), order.to(torch.int32).contiguous()


def _config(kernel: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` for inputs like ``t`` (read at call time)."""
    if interpreted() or t.device.type != "cuda":
        return INTERPRETER_CONFIG
    fp32 = t.dtype == torch.float32
    return {
        "forward": FP32_FORWARD_CONFIG if fp32 else FORWARD_CONFIG,
        "backward_kv": FP32_BACKWARD_KV_CONFIG if fp32 else BACKWARD_KV_CONFIG,
        "backward_q": FP32_BACKWARD_Q_CONFIG if fp32 else BACKWARD_Q_CONFIG,
    }[kernel]


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _dims(hn: int, hnv: int) -> dict:
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(hn)),
        "BLOCK_DV": max(16, triton.next_power_of_2(hnv)),
        "HEAD_DIM": hn,
        "HEAD_DIM_V": hnv,
    }


class _TritonSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, topk_indices, scale):
        sq, b, heads, hn = query.shape
        skv, hnv = key.shape[0], value.shape[-1]
        bits = _selection_bits(topk_indices, sq, skv)
        block_m, block_n, warps, stages = _config("forward", query)
        counts, blocks = _tile_lists(_occupancy(bits, block_m, block_n, skv))
        # the result is returned whole (a returned view of a saved tensor would refuse in-place use
        # downstream); the kernel writes it through a [sq, b, heads, hnv] view
        result = torch.empty(sq, b, heads * hnv, dtype=value.dtype, device=value.device)
        out = result.view(sq, b, heads, hnv)
        lse = torch.empty(b, heads, sq, dtype=torch.float32, device=query.device)
        grid = (-(-sq // block_m), b * heads)
        _forward[grid](
            query, key, value, out, lse, bits, counts, blocks, sq, skv, heads, bits.shape[-1], blocks.shape[-1],
            *_strides(query), *_strides(key), *_strides(value), *_strides(out), scale * _LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, **_dims(hn, hnv), PRECISION=precision(query.dtype),
            INTERPRETED=interpreted(), num_warps=warps, num_stages=stages,
        )  # fmt: skip
        ctx.save_for_backward(query, key, value, result, lse, bits, counts, blocks)
        ctx.scale = scale
        ctx.forward_blocks = (block_m, block_n)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, result, lse, bits, fwd_counts, fwd_blocks = ctx.saved_tensors
        scale = ctx.scale
        sq, b, heads, hn = query.shape
        skv, hnv = key.shape[0], value.shape[-1]
        out = result.view(sq, b, heads, hnv)
        grad_out = unit_last_stride(grad_out.reshape(sq, b, heads, hnv))
        dims = _dims(hn, hnv)
        precision_, interpreted_ = precision(query.dtype), interpreted()

        delta = torch.empty_like(lse)
        delta_rows, delta_warps = (16, 1) if interpreted_ or query.device.type != "cuda" else DELTA_CONFIG
        _delta[(-(-sq // delta_rows), b * heads)](
            out, grad_out, delta, sq, heads, *_strides(out), *_strides(grad_out),
            BLOCK_M=delta_rows, BLOCK_DV=dims["BLOCK_DV"], HEAD_DIM_V=hnv, num_warps=delta_warps,
        )  # fmt: skip

        block_m, block_n, warps, stages = _config("backward_kv", query)
        counts, blocks = _tile_lists(_occupancy(bits, block_m, block_n, skv).transpose(1, 2))
        dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        _backward_kv[(-(-skv // block_n), b * heads)](
            query, key, value, grad_out, lse, delta, dk, dv, bits, counts, blocks, sq, skv, heads, bits.shape[-1],
            blocks.shape[-1], *_strides(query), *_strides(key), *_strides(value), *_strides(grad_out),
            *_strides(dk), *_strides(dv), scale, scale * _LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, **dims,
            PRECISION=precision_, INTERPRETED=interpreted_, num_warps=warps, num_stages=stages,
        )  # fmt: skip

        block_m, block_n, warps, stages = _config("backward_q", query)
        if (block_m, block_n) == ctx.forward_blocks:
            counts, blocks = fwd_counts, fwd_blocks
        else:
            counts, blocks = _tile_lists(_occupancy(bits, block_m, block_n, skv))
        dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        _backward_q[(-(-sq // block_m), b * heads)](
            query, key, value, grad_out, lse, delta, dq, bits, counts, blocks, sq, skv, heads, bits.shape[-1],
            blocks.shape[-1], *_strides(query), *_strides(key), *_strides(value), *_strides(grad_out),
            *_strides(dq), scale, scale * _LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, **dims, PRECISION=precision_,
            INTERPRETED=interpreted_, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return dq, dk, dv, None, None


def sparse_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """``unfused_dsa_fn``'s result (same layouts and dtype) from Triton kernels; differentiable.

    ``key``/``value`` carry one head per query head (``sparse_attention_mqa_triton`` takes one shared head).
    """
    check_attention_layout(query, key, value, topk_indices)
    _, b, heads, hn = query.shape
    skv, kv_heads = key.shape[0], key.shape[2]
    if topk_indices.dtype.is_floating_point or topk_indices.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise ValueError(f"topk_indices has dtype {topk_indices.dtype}: expected an integer dtype")
    if key.shape[1] != b or key.shape[3] != hn or value.shape[:3] != (skv, b, kv_heads):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match query {tuple(query.shape)}")
    if kv_heads != heads:
        raise ValueError(
            f"key/value have {kv_heads} heads: expected {heads} (one per query head); one key head shared by every "
            "query head (MQA / absorbed MLA) is dsa_attention_mqa_triton.sparse_attention_mqa_triton's, which "
            "verl_npu.ops.dispatch routes it to"
        )
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype}: expected one of bf16, fp16, fp32 for all"
        )
    if not (query.device == key.device == value.device == topk_indices.device):
        raise ValueError(
            f"query, key, value and topk_indices must be on one device; got {query.device}, {key.device}, "
            f"{value.device}, {topk_indices.device}"
        )
    query, key, value = (unit_last_stride(t) for t in (query, key, value))
    return _TritonSparseAttention.apply(query, key, value, topk_indices, float(softmax_scale))
