"""Offload arenas on Ascend (npu tier): power-of-two pinned chunks by default, torch_npu's host stats as witness.

torch_npu keeps ATen's CachingHostAllocator for pinned memory: every block is rounded up to a power
of two and freed blocks stay cached until ``torch_npu.npu.host_empty_cache()``. Without host
registration in torch_npu, the manager's arena is chunks that the rounding gives exactly.
"""

from __future__ import annotations

import pytest
import torch
from support.offload_tensors import fingerprint, pinned_allocated_bytes, settled_pinned_bytes, tensor_set

from verl_npu.engine.host_arena import CHUNKED, host_bytes, next_power_of_two, power_of_two_chunks
from verl_npu.engine.offload import OffloadManager, host_empty_cache_call

pytestmark = pytest.mark.npu
ARENA_KINDS = ("params", "optimizer")


@pytest.fixture(scope="module")
def npu() -> torch.device:
    import torch_npu  # noqa: F401  (registers torch.npu)

    torch.npu.set_device(0)
    return torch.device("npu", 0)


def test_the_npu_host_cache_is_emptied_by_torch_npus_call(npu):
    import torch_npu

    assert host_empty_cache_call("npu", torch.npu) is torch_npu.npu.host_empty_cache
    assert callable(getattr(torch_npu.npu, "host_memory_stats", None))


def test_default_npu_arena_is_power_of_two_chunks_pinned_exactly_and_given_back_on_close(npu, monkeypatch):
    import torch_npu

    module, optimizer = tensor_set(npu, seed=5)
    baseline = settled_pinned_bytes(npu)
    empties = []
    real_empty = torch_npu.npu.host_empty_cache
    monkeypatch.setattr(torch_npu.npu, "host_empty_cache", lambda: empties.append(1) or real_empty())
    before = fingerprint(module, optimizer)
    manager = OffloadManager([module], optimizer, device=npu)
    assert manager.arena_strategy == CHUNKED
    manager.offload()
    manager.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, fingerprint(module, optimizer), strict=True))
    needs = {kind: manager._arena_bytes(kind) for kind in ARENA_KINDS}
    for kind, need in needs.items():
        arena = manager._arenas[kind]
        assert arena.pinned and arena.plan == power_of_two_chunks(need)
        assert arena.nbytes == host_bytes("ascend", need)  # preflight's host model for Ascend
    torch.npu.synchronize()
    grown = pinned_allocated_bytes(torch_npu.npu) - baseline
    assert grown == manager.host_bytes() == sum(power_of_two_chunks(n).nbytes for n in needs.values())
    assert grown < sum(next_power_of_two(n) for n in needs.values())
    manager.close()
    assert empties, "close() did not call torch_npu.npu.host_empty_cache"
    assert pinned_allocated_bytes(torch_npu.npu) == baseline
