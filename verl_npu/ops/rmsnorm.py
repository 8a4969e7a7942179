"""RMSNorm: the module behind ``use_fused_rmsnorm``, and its portable implementation.

y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 and returned in x's dtype, the
contract of ``torch_npu.npu_rms_norm(x, gamma, epsilon)[0]``. The module runs the best backend for
its input's device (verl_npu.ops.dispatch: torch_npu on Ascend, Triton on CUDA, this elsewhere).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Drop-in for megatron's local RMSNorm (``WrappedTorchNorm``): same constructor and state dict."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("verl_npu RMSNorm does not support zero-centered gamma")
        if normalization != "RMSNorm" or config.normalization != "RMSNorm":
            raise ValueError(f"fused RMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        self.eps = eps
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from verl_npu.ops import dispatch

        return dispatch.rms_norm(x, self.weight, self.eps)
