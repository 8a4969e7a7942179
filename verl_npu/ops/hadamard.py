"""Walsh-Hadamard transform in plain PyTorch (runs on NPU, CUDA and CPU, differentiable).

Same contract as ``fast_hadamard_transform.hadamard_transform(x, scale)``: transforms the last
dimension with the Sylvester-ordered Hadamard matrix, multiplies by ``scale``, keeps the shape and
dtype of ``x``. A last dimension that is not a power of two is zero-padded to the next power of
two and the result truncated back, as the CUDA extension does.
"""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    dim = x.shape[-1]
    if dim == 0:
        return x.clone()
    size = 1 << (dim - 1).bit_length()
    # fp32 accumulation: log2(size) butterfly stages of adds would lose bf16/fp16 precision.
    y = x.reshape(-1, dim).to(torch.float32)
    if size != dim:
        y = torch.nn.functional.pad(y, (0, size - dim))
    rows = y.shape[0]
    h = 1
    while h < size:
        y = y.view(rows, size // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(rows, size)[:, :dim] * scale
    return y.to(x.dtype).reshape(x.shape)


def hadamard_matrix(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The explicit Sylvester Hadamard matrix (size a power of two): the reference for tests."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"size must be a power of two, got {size}")
    matrix = torch.ones(1, 1, dtype=dtype)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix
