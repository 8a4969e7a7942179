"""LayerNorm for megatron's local spec that works under sequence parallelism.

megatron-core 0.18's local norm builder (``WrappedTorchNorm``) asserts ``sequence_parallel=False``,
so a local-spec model with a LayerNorm anywhere cannot run TP>1 with sequence parallelism. DSA's
indexer has one (its key norm is a LayerNorm by design, whatever the model's normalization). This
module is ``torch.nn.LayerNorm`` with megatron's norm constructor, and, like TransformerEngine's
norm, marks its parameters ``sequence_parallel`` so megatron all-reduces their gradients over the
tensor-parallel group (``finalize_model_grads``).
"""

from __future__ import annotations

import torch


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
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("verl_npu LayerNorm does not support zero-centered gamma")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
