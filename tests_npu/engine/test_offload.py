"""Offload manager on real megatron objects (tiny GPT + DDP + distributed optimizer) under the CPU harness.

Each test runs with the CPU's own arena (one pageable allocation) where it is about the manager,
and the chunked one (the Ascend layout: power-of-two chunks, storages split across them) where the
layout matters; the pinned variants run in test_offload_accel.py and test_offload_npu.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

import pytest
import torch
from support import offload_tensors

from verl_npu.engine.host_arena import ARENA_ENV, CHUNKED, PAGEABLE, power_of_two_chunks
from verl_npu.engine.offload import KINDS, OffloadManager, _optimizers
from verl_npu.testing import cpu_megatron


def state_bytes(ddp, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor, as raw bytes (a bit-exact fingerprint)."""
    out = {f"param.{n}": p.detach().clone().view(torch.uint8) for n, p in ddp.named_parameters()}
    for i, inner in enumerate(_optimizers(optimizer)):
        for j, (param, state) in enumerate(inner.state.items()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[f"opt{i}.{j}.{key}"] = value.detach().clone().contiguous().view(torch.uint8)
            out[f"opt{i}.{j}.main"] = param.detach().clone().contiguous().view(torch.uint8)
    return out


pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")


@pytest.fixture
def trained():
    ddp, optimizer = cpu_megatron.tiny_gpt(seed=7)
    for step in range(2):
        cpu_megatron.train_step(ddp, optimizer, step)
    return ddp, optimizer


def test_round_trip_is_bit_exact_for_every_state_key_and_dtype(trained):
    ddp, optimizer = trained
    inner = next(_optimizers(optimizer))
    first = next(iter(inner.state))
    # Keys and dtypes we have not seen: an int16 remainder (precision-aware master_param) and a new key.
    inner.state[first]["master_param"] = torch.randint(-(2**15), 2**15 - 1, first.shape, dtype=torch.int16)
    inner.state[first]["some_future_key"] = torch.randn(3, 5, dtype=torch.bfloat16)
    before = state_bytes(ddp, optimizer)
    manager = OffloadManager([ddp], optimizer, device="cpu")
    manager.offload()
    assert all(s.storage.nbytes() == 0 for k in ("params", "optimizer") for s in manager._slots[k])
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in ddp.buffers)
    manager.onload()
    after = state_bytes(ddp, optimizer)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in ddp.buffers), "gradients must come back zeroed"


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_training_with_offload_between_steps_equals_training_without(arena):
    ddp_a, opt_a = cpu_megatron.tiny_gpt(seed=11)
    reference = [cpu_megatron.train_step(ddp_a, opt_a, step) for step in range(4)]
    ddp_b, opt_b = cpu_megatron.tiny_gpt(seed=11)
    manager = OffloadManager([ddp_b], opt_b, device="cpu", arena=arena)
    losses = []
    for step in range(4):
        losses.append(cpu_megatron.train_step(ddp_b, opt_b, step))
        manager.offload()
        manager.onload()
    assert losses == reference  # exact, not approximately


def chunk_pointers(manager: OffloadManager) -> dict[str, list[int]]:
    return {kind: [chunk.data_ptr() for chunk in arena.chunks] for kind, arena in manager._arenas.items()}


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_one_arena_per_kind_allocated_once_and_no_duplicate_host_copies(trained, arena):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu", arena=arena)
    manager.offload()
    arenas = chunk_pointers(manager)
    host = manager.host_bytes()
    for _ in range(3):
        manager.onload()
        manager.offload()
    assert chunk_pointers(manager) == arenas
    assert manager.host_bytes() == host
    # fp32 distributed-optimizer shards alias the model's parameter buffer: stored once, under params.
    unique = {p.untyped_storage()._cdata for p in ddp.parameters()}
    param_bytes = sum(b.param_data.untyped_storage().nbytes() for b in ddp.buffers)
    assert manager._arena_bytes("params") >= param_bytes and len(unique) == 1
    optimizer_storages = {s.storage._cdata for s in manager._slots["optimizer"]}
    assert not optimizer_storages & {s.storage._cdata for s in manager._slots["params"]}


def test_offload_and_onload_are_idempotent_and_logged(trained, caplog):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu")
    with caplog.at_level(logging.DEBUG, logger="verl_npu.engine.offload"):
        manager.offload(["params"])
        manager.offload(["params"])
        manager.onload(["params"])
        manager.onload(["params"])
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("verl-npu offload params:") for m in messages) == 1
    assert sum(m.startswith("verl-npu onload params:") for m in messages) == 1
    assert all("GB/s" in m and "bytes in" in m for m in messages)


def test_checkpoint_state_is_the_same_offloaded_or_not_and_never_offloaded_works(trained):
    ddp, optimizer = trained
    expected = state_bytes(ddp, optimizer)
    never = OffloadManager([ddp], optimizer, device="cpu")
    with never.resident():  # nothing offloaded: no error, nothing moves
        assert state_bytes(ddp, optimizer).keys() == expected.keys()
    manager = OffloadManager([ddp], optimizer, device="cpu")
    manager.offload()
    with manager.resident(["params", "optimizer"]):
        saved = state_bytes(ddp, optimizer)
        model_state = {k: v.clone() for k, v in ddp.state_dict().items() if isinstance(v, torch.Tensor)}
    assert manager.on_host("params") and manager.on_host("optimizer")
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    arena = manager.snapshot_params_to_host()  # offloaded: the arena already is the snapshot
    assert arena is manager._arenas["params"]
    manager.onload()
    for key, value in ddp.state_dict().items():
        if key in model_state:
            assert torch.equal(value, model_state[key]), key


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_snapshot_to_host_copies_the_parameters_exactly(trained, arena):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu", arena=arena)
    snapshot = manager.snapshot_params_to_host()
    buffer = ddp.buffers[0].param_data
    slot = manager._slots["params"][0]
    assert torch.equal(snapshot.read(slot.offset, slot.nbytes), buffer.view(torch.uint8))
    assert len(snapshot.chunks) == (1 if arena == "auto" else len(power_of_two_chunks(slot.nbytes).chunk_sizes))
    assert not manager.on_host("params")  # a snapshot leaves the model on the device


def test_a_forward_only_model_without_ddp_offloads_its_parameters():
    """verl builds forward-only models (ref, forward_only=True) without megatron's DDP wrapper."""
    ddp, _ = cpu_megatron.tiny_gpt(seed=5)
    module = ddp.module  # the bare GPTModel: no param/grad buffers
    before = [p.detach().clone() for p in module.parameters()]
    manager = OffloadManager([module], None, device="cpu")
    manager.offload(["params"])
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    manager.onload(["params"])
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


# --- the chunked arena (Ascend's layout) on the CPU ------------------------------------------------
def test_chunked_arenas_round_trip_storages_straddling_chunk_boundaries_bit_exactly(trained):
    ddp, optimizer = trained
    inner = next(_optimizers(optimizer))
    first = next(iter(inner.state))
    inner.state[first]["master_param"] = torch.randint(-(2**15), 2**15 - 1, first.shape, dtype=torch.int16)
    # megatron's shards are powers of two and would line up with the chunks; 512 odd bytes early on shift them
    inner.state[first]["some_future_key"] = torch.randn(3, 5, dtype=torch.bfloat16)
    before = state_bytes(ddp, optimizer)
    manager = OffloadManager([ddp], optimizer, device="cpu", arena="chunked")
    manager.offload()
    pieces = {}
    for kind in ("params", "optimizer"):
        arena, need = manager._arenas[kind], manager._arena_bytes(kind)
        assert arena.strategy == CHUNKED and not arena.pinned  # no accelerator: unpinned chunks
        assert arena.plan == power_of_two_chunks(need)
        assert [chunk.numel() for chunk in arena.chunks] == list(arena.plan.chunk_sizes)
        pieces[kind] = [len(arena.plan.segments(s.offset, s.nbytes)) for s in manager._slots[kind]]
    # the DDP buffer (one storage) spans all four params chunks; optimizer shards cross boundaries too
    assert pieces["params"] == [4]
    assert sum(n > 1 for n in pieces["optimizer"]) >= 3, pieces["optimizer"]
    manager.onload()
    after = state_bytes(ddp, optimizer)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in ddp.buffers)


def test_host_bytes_are_the_plans_sum_for_chunked_arenas_and_the_need_for_one_allocation(trained):
    ddp, optimizer = trained
    exact = OffloadManager([ddp], optimizer, device="cpu")
    chunked = OffloadManager([ddp], optimizer, device="cpu", arena="chunked")
    assert exact.host_bytes() == chunked.host_bytes() == 0  # nothing materialised before the first offload
    exact.offload()
    exact.onload()
    chunked.offload()
    needs = [chunked._arena_bytes(kind) for kind in ("params", "optimizer")]
    assert exact.arena_strategy == PAGEABLE and exact.host_bytes() == sum(needs)
    assert chunked.host_bytes() == sum(power_of_two_chunks(n).nbytes for n in needs)
    assert chunked.host_bytes() == sum(chunk.numel() for a in chunked._arenas.values() for chunk in a.chunks)
    chunked.onload()
    chunked.close()
    assert chunked.host_bytes() == 0


def test_the_environment_forces_the_chunked_arena_and_rejects_unknown_values(trained, monkeypatch):
    ddp, optimizer = trained
    monkeypatch.setenv(ARENA_ENV, "chunked")
    assert OffloadManager([ddp], optimizer, device="cpu").arena_strategy == CHUNKED
    assert OffloadManager([ddp], optimizer, device="cpu", arena="auto").arena_strategy == PAGEABLE
    monkeypatch.setenv(ARENA_ENV, "huge-pages")
    with pytest.raises(ValueError, match=ARENA_ENV):
        OffloadManager([ddp], optimizer, device="cpu")


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_an_arena_grows_with_the_state_and_still_round_trips(trained, arena, caplog):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu", arena=arena)
    manager.offload(["optimizer"])
    manager.onload(["optimizer"])
    small = manager._arenas["optimizer"].nbytes
    inner = next(_optimizers(optimizer))
    inner.state[next(iter(inner.state))]["late_key"] = torch.randn(50_000)  # 200 KB more optimizer state
    before = state_bytes(ddp, optimizer)
    with caplog.at_level(logging.INFO, logger="verl_npu.engine.offload"):
        manager.offload()
    assert any("optimizer arena grows" in r.getMessage() for r in caplog.records)
    assert manager._arenas["optimizer"].nbytes >= manager._arena_bytes("optimizer") > small
    manager.onload()
    after = state_bytes(ddp, optimizer)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_a_manager_built_before_the_first_step_has_room_for_adams_moments(arena, caplog):
    """verl builds the manager at the engine's start, before Adam has created its moments; the first offload after the
    first step must use the arena allocated then (growing it would pin twice the optimizer's bytes, synchronously)."""
    ddp, optimizer = cpu_megatron.tiny_gpt(seed=5)
    inner = next(_optimizers(optimizer))
    assert not any(inner.state.values()), "the fixture's optimizer has stepped already"
    manager = OffloadManager([ddp], optimizer, device="cpu", arena=arena)
    reserved = manager._pending_arenas["optimizer"].result().nbytes
    cpu_megatron.train_step(ddp, optimizer, 0)
    assert all(v.get("exp_avg") is not None for v in inner.state.values())
    before = state_bytes(ddp, optimizer)
    with caplog.at_level(logging.INFO, logger="verl_npu.engine.offload"):
        manager.offload()
    assert not any("arena grows" in r.getMessage() for r in caplog.records)
    assert manager._arena_bytes("optimizer") <= reserved == manager._arenas["optimizer"].nbytes
    if arena == "auto":  # one allocation of what was asked (chunks round up): no slack beyond alignment
        assert reserved - manager._arena_bytes("optimizer") < 512
    manager.onload()
    after = state_bytes(ddp, optimizer)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("arena", ["auto", "chunked"])
def test_a_plain_tensor_set_round_trips_every_kind(arena):
    """The tensor set the accelerator tiers pin (support/offload_tensors.py), here in host memory."""
    module, optimizer = offload_tensors.tensor_set("cpu", seed=3)
    before = offload_tensors.fingerprint(module, optimizer)
    manager = OffloadManager([module], optimizer, device="cpu", arena=arena)
    manager.offload(KINDS)
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    manager.onload(KINDS)
    assert all(torch.equal(a, b) for a, b in zip(before, offload_tensors.fingerprint(module, optimizer), strict=True))
    manager.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_pages_marked_dontfork_are_absent_from_a_forked_child_and_back_once_unmarked():
    """What the registered arena's MADV_DONTFORK does (a child reading the arena dies; unmarked, it reads it)."""
    from verl_npu.engine.offload import MADV_DOFORK, MADV_DONTFORK, madvise_pages

    memory = torch.full((1 << 24,), 7, dtype=torch.uint8)
    middle = memory.data_ptr() + memory.nbytes // 2

    def child_reads() -> int:
        pid = os.fork()
        if pid == 0:
            os._exit(ctypes.string_at(middle, 1)[0])  # 7 where the page is mapped; SIGSEGV where it is not
        return os.waitpid(pid, 0)[1]

    assert madvise_pages(memory, MADV_DONTFORK)
    status = child_reads()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert madvise_pages(memory, MADV_DOFORK)
    status = child_reads()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7
