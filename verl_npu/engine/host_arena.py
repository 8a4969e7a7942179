"""Host arenas of the offload manager: how one is laid out and how much host RAM it really takes.

torch's pinned host memory comes from ATen's CachingHostAllocator, on CUDA and on Ascend alike
(torch_npu keeps it): every block is rounded up to a power of two, and a freed block stays cached,
still locked, until the allocator's cache is emptied. One 8.8 GB pinned arena would lock 16 GB.
An arena made of power-of-two chunks, one for each set bit of its (granule-rounded) size, loses
nothing to that rounding: the chunks sum exactly to the rounded size.

Strategies, by platform:
  * ``registered`` (CUDA): one pageable allocation of the exact size, pinned by cudaHostRegister;
    no allocator involved. Falls back to ``chunked`` when registration fails.
  * ``chunked`` (Ascend, and any accelerator without a host-registration call in torch): the
    power-of-two chunks of :func:`power_of_two_chunks`, pinned by torch's allocator.
  * ``pageable`` (CPU): one unpinned allocation of the exact size.
``chunked`` can be forced on any device (``VERL_NPU_OFFLOAD_ARENA=chunked`` or the manager's
``arena`` argument), e.g. to exercise the Ascend layout on CUDA, whose allocator rounds the same way.

Pure arithmetic, no torch: the offload manager lays its copies out with it, and preflight's memory
model (verl_npu.preflight.memory) counts host RAM with :func:`host_bytes`, so the two cannot disagree.
"""

from __future__ import annotations

import bisect
import dataclasses
import os

# A pinned allocation locks whole pages, so chunks below a page would save nothing; a 4 KiB floor
# also bounds an arena to log2(size / 4 KiB) + 1 chunks (29 for 1 TiB) and wastes < 4 KiB per arena.
GRANULE = 4096

REGISTERED, CHUNKED, PAGEABLE = "registered", "chunked", "pageable"
ARENA_ENV = "VERL_NPU_OFFLOAD_ARENA"  # "auto" (default) or "chunked"
ARENA_CHOICES = ("auto", CHUNKED)


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of a slot that lies in one chunk."""

    chunk: int  # index into the arena's chunks
    chunk_offset: int  # where the part starts in that chunk
    slot_offset: int  # where the part starts in the slot
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ArenaPlan:
    """An arena as consecutive chunks: byte ``o`` of the arena is in the chunk whose span holds ``o``."""

    chunk_sizes: tuple[int, ...]
    chunk_starts: tuple[int, ...] = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        if any(size <= 0 for size in self.chunk_sizes):
            raise ValueError(f"chunk sizes must be positive: {self.chunk_sizes}")
        starts, offset = [], 0
        for size in self.chunk_sizes:
            starts.append(offset)
            offset += size
        object.__setattr__(self, "chunk_starts", tuple(starts))

    @property
    def nbytes(self) -> int:
        """Host bytes the arena takes: the sum of its chunks."""
        return sum(self.chunk_sizes)

    def segments(self, offset: int, nbytes: int) -> list[Segment]:
        """Arena bytes [offset, offset + nbytes) as per-chunk segments, in order; a slot may span chunks."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside an arena of {self.nbytes} bytes")
        out: list[Segment] = []
        chunk = bisect.bisect_right(self.chunk_starts, offset) - 1
        done = 0
        while done < nbytes:
            at = offset + done - self.chunk_starts[chunk]
            length = min(self.chunk_sizes[chunk] - at, nbytes - done)
            out.append(Segment(chunk, at, done, length))
            done += length
            chunk += 1
        return out


def round_up(nbytes: int, granule: int = GRANULE) -> int:
    return -(-nbytes // granule) * granule


def power_of_two_chunks(nbytes: int, granule: int = GRANULE) -> ArenaPlan:
    """The binary decomposition of ``nbytes`` rounded up to ``granule``, largest chunk first.

    Every chunk is a power of two, so a power-of-two-rounding allocator gives each exactly its size.
    """
    if nbytes < 0:
        raise ValueError(f"an arena cannot have {nbytes} bytes")
    if granule <= 0 or granule & (granule - 1):
        raise ValueError(f"granule {granule} must be a power of two")
    total = round_up(nbytes, granule)
    return ArenaPlan(tuple(1 << bit for bit in reversed(range(total.bit_length())) if total >> bit & 1))


def single_chunk(nbytes: int) -> ArenaPlan:
    """One exact allocation (registered or pageable); none for an empty arena."""
    if nbytes < 0:
        raise ValueError(f"an arena cannot have {nbytes} bytes")
    return ArenaPlan((nbytes,) if nbytes else ())


def plan_arena(strategy: str, nbytes: int) -> ArenaPlan:
    if strategy == CHUNKED:
        return power_of_two_chunks(nbytes)
    if strategy in (REGISTERED, PAGEABLE):
        return single_chunk(nbytes)
    raise ValueError(f"arena strategy {strategy!r}: use {REGISTERED}, {CHUNKED} or {PAGEABLE}")


def default_strategy(platform: str) -> str:
    """``platform`` is a device type (cuda, npu, cpu, ...) or a preflight platform (cuda, ascend, cpu)."""
    if platform == "cuda":
        return REGISTERED
    if platform == "cpu":
        return PAGEABLE
    return CHUNKED  # Ascend and any other accelerator: torch offers no host registration there


def choose_strategy(device_type: str, requested: str | None = None) -> str:
    """The strategy an arena on ``device_type`` uses: ``requested``, else $VERL_NPU_OFFLOAD_ARENA, else auto."""
    choice = requested if requested is not None else (os.environ.get(ARENA_ENV) or "auto")
    if choice not in ARENA_CHOICES:
        source = "arena" if requested is not None else ARENA_ENV
        raise ValueError(f"{source}={choice!r}: use one of {', '.join(ARENA_CHOICES)}")
    return CHUNKED if choice == CHUNKED else default_strategy(device_type)


def host_bytes(platform: str, nbytes: int) -> int:
    """Host RAM an arena of ``nbytes`` takes on ``platform`` with its default strategy."""
    return plan_arena(default_strategy(platform), nbytes).nbytes


def next_power_of_two(nbytes: int) -> int:
    """What one pinned block of ``nbytes`` takes from torch's caching host allocator."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes else 0
