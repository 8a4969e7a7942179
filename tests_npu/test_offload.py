"""Offload manager on real megatron objects (tiny GPT + DDP + distributed optimizer) under the CPU harness."""

from __future__ import annotations

import logging

import pytest
import torch
from support import cpu_megatron

from verl_npu.engine.offload import OffloadManager, _optimizers


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


def test_training_with_offload_between_steps_equals_training_without():
    ddp_a, opt_a = cpu_megatron.tiny_gpt(seed=11)
    reference = [cpu_megatron.train_step(ddp_a, opt_a, step) for step in range(4)]
    ddp_b, opt_b = cpu_megatron.tiny_gpt(seed=11)
    manager = OffloadManager([ddp_b], opt_b, device="cpu")
    losses = []
    for step in range(4):
        losses.append(cpu_megatron.train_step(ddp_b, opt_b, step))
        manager.offload()
        manager.onload()
    assert losses == reference  # exact, not approximately


def test_one_arena_per_kind_allocated_once_and_no_duplicate_host_copies(trained):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu")
    manager.offload()
    arenas = {kind: arena.data_ptr() for kind, arena in manager._arenas.items()}
    host = manager.host_bytes()
    for _ in range(3):
        manager.onload()
        manager.offload()
    assert {kind: arena.data_ptr() for kind, arena in manager._arenas.items()} == arenas
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
    assert arena.data_ptr() == manager._arenas["params"].data_ptr()
    manager.onload()
    for key, value in ddp.state_dict().items():
        if key in model_state:
            assert torch.equal(value, model_state[key]), key


def test_snapshot_to_host_copies_the_parameters_exactly(trained):
    ddp, optimizer = trained
    manager = OffloadManager([ddp], optimizer, device="cpu")
    arena = manager.snapshot_params_to_host()
    buffer = ddp.buffers[0].param_data
    slot = manager._slots["params"][0]
    assert torch.equal(arena[slot.offset : slot.offset + slot.nbytes], buffer.view(torch.uint8))
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
