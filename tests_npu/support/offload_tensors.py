"""A plain tensor set for the offload manager on any device: parameters of odd sizes and dtypes + Adam state.

No megatron, no process group: the same model runs on the CPU, CUDA and an NPU, so the arena
tests of every tier share it. Sizes are chosen so that neither arena is a power of two or a
multiple of the 4 KiB granule, and the parameters arena is about 1.3 MiB past a power of two.
"""

from __future__ import annotations

import torch

# (elements, dtype): 4 MB, 1 MB and 256 KB parameters between odd small ones
PARAMETERS = (
    (1_000_003, torch.float32),
    (77, torch.bfloat16),
    (262_149, torch.float32),
    (3, torch.bfloat16),
    (131_071, torch.bfloat16),
)


def tensor_set(device: torch.device | str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A module and an Adam optimizer that has taken one step (so exp_avg / exp_avg_sq exist)."""
    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n, generator=generator).to(device=device, dtype=dtype))
        for n, dtype in PARAMETERS
    )
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    sum(p.float().square().sum() for p in module.parameters()).backward()
    optimizer.step()
    return module, optimizer


def fingerprint(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer-state tensor as raw bytes on the host (a bit-exact fingerprint)."""
    tensors = list(module.parameters())
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    return [t.detach().contiguous().view(torch.uint8).cpu().clone() for t in tensors]


def pinned_allocated_bytes(device_module) -> int | None:
    """Bytes torch's caching host allocator holds (blocks in use and cached), or None without its stats."""
    stats = getattr(device_module, "host_memory_stats", None)
    if stats is None:
        return None
    value = stats().get("allocated_bytes.current")
    return None if value is None else int(value)


def settled_pinned_bytes(device: torch.device) -> int:
    """The pinned allocator's bytes once the device is idle and its cache emptied; skips without the API."""
    import pytest

    from verl_npu.engine.offload import host_empty_cache_call

    accel = torch.get_device_module(device.type)
    accel.synchronize()
    empty = host_empty_cache_call(device.type, accel)
    if empty is None:
        pytest.skip(f"this torch has no call that empties the {device.type} pinned-memory cache")
    empty()
    value = pinned_allocated_bytes(accel)
    if value is None:
        pytest.skip(f"torch.{device.type}.host_memory_stats() has no 'allocated_bytes.current' here")
    return value
