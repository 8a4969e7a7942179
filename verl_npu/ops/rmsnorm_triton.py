"""RMSNorm forward and backward as Triton kernels (CUDA; the interpreter runs them on CPU for tests).

One program per row in forward (fp32 statistics, the row's 1/rms kept for backward); backward
runs one program per SM, each over a run of rows with the next row's loads in flight, keeping its
weight-gradient partial sum in registers (one small reduction adds them up), so each element of x,
dy and dx crosses HBM once. Optional residual add fused in front: ``h = x + residual`` is
normalised and returned, as pre-norm layers need it. Kept to the Triton subset triton-ascend
compiles (no inline PTX, no atomics, power-of-two blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _forward(X, R, W, Y, H, RSTD, stride, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + row * stride + cols, x.to(H.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _backward(
    DY, X, W, RSTD, DX, DW_PARTIAL, stride, n_rows, n_cols, ROWS: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr
):
    """ITERS tiles of ROWS rows per program: dx of each row; the program's weight-gradient partial sum."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    rows = program * ITERS * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * stride + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0)
    dy = tl.load(DY + offsets, mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    # a compile-time trip count: the host buckets it to powers of two, so few variants compile
    for i in range(0, ITERS):
        # the next tile's loads are issued before this tile's arithmetic: a program has one tile in
        # flight, and without the prefetch every tile waits a full HBM round trip
        next_rows = rows + ROWS
        next_row_mask = (next_rows < n_rows) & (i + 1 < ITERS)
        next_mask = next_row_mask[:, None] & col_mask[None, :]
        next_offsets = next_rows[:, None] * stride + cols[None, :]
        next_x = tl.load(X + next_offsets, mask=next_mask, other=0.0)
        next_dy = tl.load(DY + next_offsets, mask=next_mask, other=0.0)
        next_rstd = tl.load(RSTD + next_rows, mask=next_row_mask, other=0.0)
        xhat = x.to(tl.float32) * rstd[:, None]
        dy32 = dy.to(tl.float32)
        wdy = w[None, :] * dy32
        dx = rstd[:, None] * (wdy - xhat * (tl.sum(xhat * wdy, axis=1) / n_cols)[:, None])
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy32 * xhat, axis=0)
        rows, mask, offsets, x, dy, rstd = next_rows, next_mask, next_offsets, next_x, next_dy, next_rstd
    tl.store(DW_PARTIAL + program * BLOCK + cols, dw, mask=col_mask)


# launch settings, swept on nvidia-h200 at 16k x 6144 bf16 with triton.testing.do_bench (None: by row width):
# the backward was fastest at 1 row x 16 warps x 1 program per SM; 2 rows per tile spill registers
FORWARD_WARPS: int | None = 8
BACKWARD_WARPS: int | None = 16
BACKWARD_ROWS = 1  # rows per backward tile
BACKWARD_PROGRAMS_PER_SM = 1  # fewer programs: smaller weight-gradient partials; more: more parallelism


def _launch_config(n_cols: int, warps: int | None = None) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, warps or min(max(block // 256, 1), 16)


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        block, warps = _launch_config(cols, FORWARD_WARPS)
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if residual is not None:
            r2 = residual.reshape(-1, cols).contiguous()
            h = torch.empty_like(x2)
        else:
            r2, h = x2, y  # unused by the kernel (HAS_RESIDUAL=False)
        _forward[(rows,)](x2, r2, weight, y, h, rstd, x2.stride(0), cols, eps,
                          HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps)  # fmt: skip
        normalised_input = h if residual is not None else x2
        ctx.save_for_backward(normalised_input, weight, rstd)
        ctx.shape = shape
        if residual is not None:
            return y.reshape(shape), h.reshape(shape)
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        block, warps = _launch_config(cols, BACKWARD_WARPS)
        tiles = -(-rows // BACKWARD_ROWS)
        target = BACKWARD_PROGRAMS_PER_SM * _multiprocessors(x2.device)
        iters = triton.next_power_of_2(max(-(-tiles // target), 1))
        programs = -(-tiles // iters)
        dx = torch.empty_like(x2)
        partial = torch.empty(programs, block, dtype=torch.float32, device=x2.device)
        _backward[(programs,)](dy2, x2, weight, rstd, dx, partial, x2.stride(0), rows, cols, ROWS=BACKWARD_ROWS,
                               ITERS=iters, BLOCK=block, num_warps=warps)  # fmt: skip
        dweight = partial[:, :cols].sum(0).to(weight.dtype)
        dx = dx.reshape(ctx.shape)
        if dh is not None:  # the residual output h feeds later layers: its gradient joins x's and residual's
            dx = dx + dh
            return dx, dweight, dx, None
        return dx, dweight, None, None


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter on CPU: a couple of programs, so the loop runs several tiles


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """RMSNorm of ``x`` (or of ``x + residual``, then also returned) over the last dim; fp32 statistics."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return _TritonRMSNorm.apply(x, weight, residual, eps)
