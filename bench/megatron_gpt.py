"""The benchmarks' megatron GPT: model + DDP + distributed optimizer, and one training step.

Shared by bench/offload.py and bench/multi_device.py (the tests' CPU harness is
verl_npu/testing/cpu_megatron.py). Model parallel state must already be initialised.
"""

from __future__ import annotations

import torch


def init_single_gpu() -> None:
    """torch.distributed (NCCL) and megatron's parallel state for one process on CUDA device 0."""
    from verl_npu.testing.distributed import init_single_process

    init_single_process("nccl", device_index=0)


def build_gpt(hidden: int, layers: int, vocab: int, seq: int):
    """(ddp, optimizer): a bf16 GPT on the local spec, fp32 main parameters, on the current CUDA device."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128, ffn_hidden_size=4 * hidden,
        params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=seq,
    ).cuda()
    model = Float16Module(config, model)  # bf16 compute with fp32 inputs/outputs, as megatron's trainers wrap it
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, params_dtype=torch.bfloat16
        ),
        [ddp],
    )
    return ddp, optimizer


def train_step(ddp, optimizer, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Forward, backward, gradient sync and optimizer step; returns the (detached) loss."""
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    finalize_model_grads([ddp])  # data-parallel sync, plus the tensor-parallel all-reduce of SP norm grads
    optimizer.step()
    return loss.detach()
