"""CPU test harness for megatron-core 0.18: run a tiny GPT + DDP + distributed optimizer on CPU.

Megatron hard-codes CUDA in RNG seeding, buffer placement, the optimizer's overflow buffer and a
few type checks. Ascend's adaptor redirects those calls to the NPU; this harness redirects them to
the CPU, in this test process only, so the engine's platform-neutral pieces run against real
megatron objects in CI. It stands in for the accelerator, nothing else: model, DDP buffers,
optimizer and its state are megatron's own.
"""

from __future__ import annotations

import torch

from verl_npu.engine.cpu_device import activate, deactivate

__all__ = ["activate", "deactivate", "init_model_parallel", "run_step", "tiny_gpt", "train_step"]


def init_model_parallel() -> None:
    from verl_npu.testing.distributed import init_single_process

    init_single_process("gloo")


def tiny_gpt(seed: int = 1234, *, distributed_optimizer: bool = True, hidden: int = 64, layers: int = 2):
    """(ddp_model, optimizer) for a tiny GPT on CPU, deterministic for a given seed."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    activate()
    init_model_parallel()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=128,
        max_sequence_length=32,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32
        ),
        [ddp],
    )
    return ddp, optimizer


def train_step(ddp, optimizer, step: int) -> float:
    """One deterministic training step on a fixed batch derived from ``step``; returns the loss."""
    gen = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    return run_step(ddp, optimizer, tokens, torch.arange(16).unsqueeze(0).expand(2, -1))


def run_step(ddp, optimizer, tokens: torch.Tensor, positions: torch.Tensor) -> float:
    """Forward, backward, gradient sync and optimizer step of a megatron DDP model; returns the loss."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return loss.item()
