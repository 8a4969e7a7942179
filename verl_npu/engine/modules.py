"""The torch modules verl-npu's megatron specs instantiate in place of megatron's local ones.

megatron builds them from a spec with its own constructor arguments; their maths is in verl_npu.ops
(pure functions and kernels), these only hold the parameters and megatron's conventions:

* ``RMSNorm``: the module behind ``use_fused_rmsnorm``. y = x / sqrt(mean(x^2, -1) + eps) * weight,
  fp32 statistics, x's dtype out (the contract of ``torch_npu.npu_rms_norm(x, gamma, epsilon)[0]``),
  on the best backend for its input's device (verl_npu.ops.dispatch: torch_npu on Ascend, Triton on
  CUDA, plain PyTorch elsewhere).
* ``LayerNorm``: a local LayerNorm that works under sequence parallelism. megatron-core 0.18's local
  norm builder (``WrappedTorchNorm``) asserts ``sequence_parallel=False``, so a local-spec model with
  a LayerNorm anywhere cannot run TP>1 with sequence parallelism. DSA's indexer has one (its key norm
  is a LayerNorm by design, whatever the model's normalization). This is ``torch.nn.LayerNorm`` with
  megatron's norm constructor, and, like TransformerEngine's norm, marks its parameters
  ``sequence_parallel`` so megatron all-reduces their gradients over the tensor-parallel group
  (``finalize_model_grads``).
* ``DuplicatedLinear``: what ``LocalSpecProvider.linear()`` returns (runtime patch dsa-local-spec-linear).
"""

from __future__ import annotations

import torch


def _parameter_device(config):
    """Where megatron creates a module's parameters: the CPU with use_cpu_initialization, else the current device."""
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _refuse_zero_centered_gamma(config, kind: str, zero_centered_gamma: bool) -> None:
    if zero_centered_gamma or config.layernorm_zero_centered_gamma:
        raise ValueError(f"verl_npu {kind} does not support zero-centered gamma")


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
        _refuse_zero_centered_gamma(config, "RMSNorm", zero_centered_gamma)
        if normalization != "RMSNorm" or config.normalization != "RMSNorm":
            raise ValueError(f"fused RMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        device = _parameter_device(config)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        self.eps = eps
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from verl_npu.ops import dispatch

        return dispatch.rms_norm(x, self.weight, self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for megatron's local LayerNorm (``WrappedTorchNorm``): same constructor and state dict."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        _refuse_zero_centered_gamma(config, "LayerNorm", zero_centered_gamma)
        super().__init__(hidden_size, eps=eps, device=_parameter_device(config), dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


class DuplicatedLinear(torch.nn.Module):
    """y = x W^T (+ b) with the full weight on every tensor-parallel rank.

    Accepts the constructor arguments MLA and the DSA indexer pass to ``backend.linear()``, and
    returns ``(output, bias)`` like megatron's parallel linears. With sequence parallelism the
    input is sequence-sharded, so each rank's weight gradient is partial: the parameters carry
    ``sequence_parallel=True`` and megatron all-reduces them over the tensor-parallel group.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool = True,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        gather_output: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        name: str | None = None,
    ):
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear only supports parallel_mode='duplicated', got {parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear always allocates its weight (skip_weight_param_allocation=True given)")
        self.config = config
        self.skip_bias_add = skip_bias_add and bias
        device = _parameter_device(config)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=config.params_dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=config.params_dtype)) if bias else None
        )
        if config.perform_initialization:
            init_method(self.weight)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
            param.allreduce = not (is_expert and config.expert_model_parallel_size > 1)

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {}, sharded_offsets)
