"""megatron-core on the CPU: its hard-coded CUDA calls redirected to the CPU, in this process.

Megatron hard-codes CUDA in RNG seeding, buffer placement, the optimizer's overflow buffer and a few type
checks. Ascend's adaptor redirects those calls to the NPU; :func:`activate` redirects them to the CPU, so the
engine's platform-neutral pieces run against real megatron objects on a machine without an accelerator:
``verl-npu parity run`` on the CPU, and the CPU test tier (verl_npu.testing.cpu_megatron). It stands in for the
accelerator, nothing else: model, DDP buffers, optimizer and its state are megatron's own.
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)  # megatron checks for cuda tensor types
        return func(*args, **kwargs)


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


_saved: list[tuple[object, str, object]] = []
_mode: _CudaToCpu | None = None


def _replace(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def activate() -> None:
    """Redirect megatron's CUDA calls to the CPU until :func:`deactivate` (idempotent)."""
    global _mode
    if _mode is not None:
        return
    import megatron.core.tensor_parallel.random as megatron_random

    _replace(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _replace(torch.cuda, "is_available", lambda: False)
    _replace(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    _replace(torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    _replace(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    _replace(megatron_random, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state))
    _replace(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    # verl logs device memory around offload; on the CPU "device" memory is host memory.
    _replace(torch.cuda, "mem_get_info", lambda *args, **kwargs: _host_memory())
    _replace(torch.cuda, "memory_allocated", lambda *args, **kwargs: 0)
    _replace(torch.cuda, "memory_reserved", lambda *args, **kwargs: 0)
    _replace(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    _replace(torch.cuda, "empty_cache", lambda: None)
    _mode = _CudaToCpu()
    _mode.__enter__()


def deactivate() -> None:
    """Undo :func:`activate`: the rest of this process sees the real torch.cuda again."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
