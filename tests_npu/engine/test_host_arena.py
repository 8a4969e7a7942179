"""Host arena plans (verl_npu.engine.host_arena): power-of-two chunks that sum to the need, slots split across them."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from verl_npu.engine.host_arena import (
    ARENA_ENV,
    CHUNKED,
    GRANULE,
    PAGEABLE,
    REGISTERED,
    ArenaPlan,
    choose_strategy,
    host_bytes,
    next_power_of_two,
    plan_arena,
    power_of_two_chunks,
    round_up,
    single_chunk,
)

SIZES = [0, 1, 511, 512, 4095, 4096, 4097, 8192, 12288, 1_000_003, 2**20, 2**20 + 1, 8_800_000_000, 2**40 - 1]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("nbytes", SIZES)
def test_chunks_are_distinct_powers_of_two_largest_first_and_sum_to_the_rounded_need(nbytes):
    plan = power_of_two_chunks(nbytes)
    assert plan.nbytes == round_up(nbytes, GRANULE) == sum(plan.chunk_sizes)
    assert 0 <= plan.nbytes - nbytes < GRANULE
    assert all(is_power_of_two(size) and size >= GRANULE for size in plan.chunk_sizes)
    assert list(plan.chunk_sizes) == sorted(set(plan.chunk_sizes), reverse=True)  # one per set bit
    assert len(plan.chunk_sizes) == bin(plan.nbytes).count("1")
    assert plan.chunk_starts == tuple(sum(plan.chunk_sizes[:i]) for i in range(len(plan.chunk_sizes)))


def test_an_npu_arena_takes_the_chunk_sum_not_the_power_of_two_round_up():
    """The Ascend default: what one pinned block would take (2x at worst) against what the chunks take."""
    nbytes = 8_800_000_000  # an 8.8 GB arena: one pinned block locks 16 GiB
    assert next_power_of_two(nbytes) == 2**34
    assert host_bytes("ascend", nbytes) == host_bytes("npu", nbytes) == power_of_two_chunks(nbytes).nbytes
    assert host_bytes("ascend", nbytes) == 8_800_002_048 < next_power_of_two(nbytes)
    assert host_bytes("cuda", nbytes) == host_bytes("cpu", nbytes) == nbytes  # one exact allocation
    assert host_bytes("ascend", 0) == host_bytes("cuda", 0) == 0


def test_tiny_zero_and_huge_arenas():
    assert power_of_two_chunks(0) == ArenaPlan(()) and power_of_two_chunks(0).segments(0, 0) == []
    assert power_of_two_chunks(1).chunk_sizes == (GRANULE,)
    assert power_of_two_chunks(GRANULE + 1).chunk_sizes == (2 * GRANULE,)
    assert power_of_two_chunks(3 * GRANULE).chunk_sizes == (2 * GRANULE, GRANULE)
    huge = power_of_two_chunks(2**40 - GRANULE)  # every bit from 4 KiB up to 512 GiB: 28 chunks
    assert huge.chunk_sizes == tuple(2**b for b in range(39, 11, -1)) and huge.nbytes == 2**40 - GRANULE
    assert power_of_two_chunks(2**40 - 1).chunk_sizes == (2**40,)  # rounded up to the granule: one chunk
    assert single_chunk(0).chunk_sizes == () and single_chunk(5).chunk_sizes == (5,)
    with pytest.raises(ValueError, match="cannot have -1 bytes"):
        power_of_two_chunks(-1)
    with pytest.raises(ValueError, match="power of two"):
        power_of_two_chunks(10, granule=3)


def slots_like_the_manager(sizes: list[int], align: int = 512) -> list[tuple[int, int]]:
    """(offset, nbytes) of each slot, laid out as OffloadManager does: each start aligned to 512 bytes."""
    slots, offset = [], 0
    for size in sizes:
        slots.append((offset, size))
        offset += round_up(size, align)
    return slots


@pytest.mark.parametrize("seed", range(20))
def test_segments_cover_every_slot_exactly_once_and_in_order(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 7, 512, 4096, 5000, 65_537, 1 << rng.randint(0, 20)]) for _ in range(rng.randint(1, 40))]
    slots = slots_like_the_manager(sizes)
    need = slots[-1][0] + slots[-1][1]
    plan = power_of_two_chunks(need)
    covered = bytearray(plan.nbytes)
    straddling = 0
    for offset, nbytes in slots:
        segments = plan.segments(offset, nbytes)
        straddling += len(segments) > 1
        assert [s.chunk for s in segments] == list(range(segments[0].chunk, segments[0].chunk + len(segments)))
        assert sum(s.nbytes for s in segments) == nbytes
        slot_at = 0
        for seg in segments:
            assert seg.slot_offset == slot_at and seg.nbytes > 0
            assert seg.chunk_offset >= 0 and seg.chunk_offset + seg.nbytes <= plan.chunk_sizes[seg.chunk]
            start = plan.chunk_starts[seg.chunk] + seg.chunk_offset
            assert start == offset + slot_at  # the arena's byte order is the chunks' order
            for byte in range(start, start + seg.nbytes):
                covered[byte] += 1
            slot_at += seg.nbytes
        for seg in segments[1:]:
            assert seg.chunk_offset == 0  # a slot continues at the start of the next chunk
    in_slots = {b for offset, nbytes in slots for b in range(offset, offset + nbytes)}
    assert all(covered[b] == (1 if b in in_slots else 0) for b in range(plan.nbytes))
    assert straddling <= len(plan.chunk_sizes) - 1  # at most one slot across each boundary


def test_a_slot_straddling_several_chunks():
    plan = power_of_two_chunks(7 * GRANULE)  # chunks of 16, 8 and 4 KiB
    assert plan.chunk_sizes == (4 * GRANULE, 2 * GRANULE, GRANULE)
    segments = plan.segments(4 * GRANULE - 10, 2 * GRANULE + 20)  # from the end of the first into the third
    assert [(s.chunk, s.chunk_offset, s.slot_offset, s.nbytes) for s in segments] == [
        (0, 4 * GRANULE - 10, 0, 10),
        (1, 0, 10, 2 * GRANULE),
        (2, 0, 2 * GRANULE + 10, 10),
    ]
    with pytest.raises(ValueError, match="outside an arena"):
        plan.segments(7 * GRANULE - 1, 2)


def test_strategy_by_device_and_the_forced_chunked_layout(monkeypatch):
    monkeypatch.delenv(ARENA_ENV, raising=False)
    assert [choose_strategy(d) for d in ("cuda", "npu", "xpu", "cpu")] == [REGISTERED, CHUNKED, CHUNKED, PAGEABLE]
    assert choose_strategy("cuda", "chunked") == choose_strategy("cpu", "chunked") == CHUNKED
    monkeypatch.setenv(ARENA_ENV, "chunked")
    assert choose_strategy("cuda") == CHUNKED and choose_strategy("cuda", "auto") == REGISTERED  # argument wins
    monkeypatch.setenv(ARENA_ENV, "pinned")
    with pytest.raises(ValueError, match="VERL_NPU_OFFLOAD_ARENA='pinned'"):
        choose_strategy("npu")
    with pytest.raises(ValueError, match="arena='registered'"):
        choose_strategy("npu", "registered")
    assert plan_arena(REGISTERED, 10).chunk_sizes == plan_arena(PAGEABLE, 10).chunk_sizes == (10,)


def test_the_planner_imports_without_torch():
    """preflight's memory model uses it, and preflight runs before torch is importable."""
    code = "import sys, verl_npu.engine.host_arena, verl_npu.preflight.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
