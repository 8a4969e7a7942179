"""One-process torch.distributed and megatron model-parallel state, as the tests and benchmarks start them
(verl_npu.engine.single_process, which ``verl-npu parity run`` uses too)."""

from __future__ import annotations

from verl_npu.engine.single_process import free_port, init_single_process

__all__ = ["free_port", "init_single_process"]
