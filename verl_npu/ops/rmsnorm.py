"""RMSNorm's portable implementation (the module megatron's spec instantiates is verl_npu.engine.modules.RMSNorm).

y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 and returned in x's dtype, the
contract of ``torch_npu.npu_rms_norm(x, gamma, epsilon)[0]``. verl_npu.ops.dispatch.rms_norm runs
the best backend for the input's device (torch_npu on Ascend, Triton on CUDA, this elsewhere).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
