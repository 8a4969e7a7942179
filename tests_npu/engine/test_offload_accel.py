"""Offload arenas in real pinned memory (accel tier: CUDA or an NPU), measured by torch's host-allocator stats.

torch's pinned allocator (ATen's CachingHostAllocator, on CUDA and under torch_npu) rounds every
block up to a power of two and caches freed blocks. The chunked arena (Ascend's default, forced
here) must make it hold exactly the plan's bytes and give them back on close(); CUDA's default
arena must not touch it at all (cudaHostRegister of one exact allocation).
"""

from __future__ import annotations

import pytest
import torch
from support.offload_tensors import fingerprint, pinned_allocated_bytes, settled_pinned_bytes, tensor_set

from verl_npu.engine.host_arena import CHUNKED, REGISTERED, next_power_of_two, power_of_two_chunks
from verl_npu.engine.offload import OffloadManager

pytestmark = pytest.mark.accel
ARENA_KINDS = ("params", "optimizer")


@pytest.fixture(scope="module")
def device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    import torch_npu  # noqa: F401  (registers torch.npu)

    torch.npu.set_device(0)
    return torch.device("npu", 0)


@pytest.fixture
def cuda(device) -> torch.device:
    if device.type != "cuda":
        pytest.skip("cudaHostRegister is CUDA's; this accelerator is " + device.type)
    return device


def round_trip(manager: OffloadManager, module, optimizer) -> None:
    before = fingerprint(module, optimizer)
    manager.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    manager.onload()
    after = fingerprint(module, optimizer)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_torchs_pinned_allocator_rounds_one_block_up_to_a_power_of_two(device):
    """The premise: one pinned arena of n bytes would lock next_power_of_two(n)."""
    tensor_set(device)  # initialises the device runtime (the stats read empty before)
    baseline = settled_pinned_bytes(device)
    nbytes = 5_312_510
    block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    assert pinned_allocated_bytes(torch.get_device_module(device.type)) - baseline == next_power_of_two(nbytes)
    del block
    assert settled_pinned_bytes(device) == baseline


def test_chunked_arena_pins_exactly_its_plan_round_trips_and_close_gives_it_back(device):
    module, optimizer = tensor_set(device, seed=1)
    accel = torch.get_device_module(device.type)
    baseline = settled_pinned_bytes(device)
    manager = OffloadManager([module], optimizer, device=device, arena="chunked")
    round_trip(manager, module, optimizer)
    needs = {kind: manager._arena_bytes(kind) for kind in ARENA_KINDS}
    for kind, need in needs.items():
        arena = manager._arenas[kind]
        assert arena.strategy == CHUNKED and arena.pinned and all(c.is_pinned() for c in arena.chunks)
        assert arena.plan == power_of_two_chunks(need) and len(arena.chunks) > 1
    planned = sum(power_of_two_chunks(n).nbytes for n in needs.values())
    assert manager.host_bytes() == planned
    accel.synchronize()
    assert pinned_allocated_bytes(accel) - baseline == planned  # not the power-of-two round-up of each arena
    assert planned < sum(next_power_of_two(n) for n in needs.values())
    for _ in range(2):  # steady state: the same chunks, nothing more pinned
        round_trip(manager, module, optimizer)
    assert pinned_allocated_bytes(accel) - baseline == planned
    manager.close()
    assert pinned_allocated_bytes(accel) == baseline  # close() emptied the allocator's cache of our chunks


def test_cuda_default_pins_one_exact_registered_allocation_outside_torchs_allocator(cuda):
    module, optimizer = tensor_set(cuda, seed=2)
    baseline = settled_pinned_bytes(cuda)
    manager = OffloadManager([module], optimizer, device=cuda, arena="auto")
    round_trip(manager, module, optimizer)
    for kind in ARENA_KINDS:
        arena = manager._arenas[kind]
        assert arena.strategy == REGISTERED and arena.registered and len(arena.chunks) == 1
        assert arena.nbytes == manager._arena_bytes(kind)
    assert manager.host_bytes() == sum(manager._arena_bytes(kind) for kind in ARENA_KINDS)
    torch.cuda.synchronize()
    assert pinned_allocated_bytes(torch.cuda) == baseline
    manager.close()


def test_a_refused_cuda_registration_falls_back_to_pinned_chunks(cuda, monkeypatch, caplog):
    module, optimizer = tensor_set(cuda, seed=4)
    baseline = settled_pinned_bytes(cuda)

    class Refusing:
        @staticmethod
        def cudaHostRegister(ptr, size, flags):  # cudart's name
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing)
    manager = OffloadManager([module], optimizer, device=cuda)
    round_trip(manager, module, optimizer)
    monkeypatch.undo()
    assert all(manager._arenas[kind].strategy == CHUNKED for kind in ARENA_KINDS)
    assert "cudaHostRegister" in caplog.text
    torch.cuda.synchronize()
    assert pinned_allocated_bytes(torch.cuda) - baseline == manager.host_bytes()
    manager.close()
    assert pinned_allocated_bytes(torch.cuda) == baseline
