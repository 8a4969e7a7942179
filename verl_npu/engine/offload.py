"""Offload manager: moves a Megatron model's state between the accelerator and one host arena per kind.

Kinds: ``params`` (DDP parameter buffers, or the parameters themselves without the distributed
optimizer), ``grads`` (DDP gradient buffers: freed, never copied, zeroed on reload as Megatron
expects) and ``optimizer`` (every tensor the optimizer holds: fp32 main parameters and every state
entry whatever its key and dtype, e.g. exp_avg, exp_avg_sq, int16 master_param remainders).

It works on storages, not tensors: every view (a parameter inside a DDP buffer, a main-grad view,
a distributed-optimizer shard that aliases a model parameter) stays valid, each storage is copied
once even when several kinds reference it, and the bytes round-trip exactly. Each kind has one host
arena, allocated once (in the background from construction, with room for the moments torch's Adam
creates at its first step, so the first offload does not pay for it) and reused: host memory never
holds two copies of the same state. Copies run on a side stream; onload makes the compute stream
wait for them instead of blocking the host. Each transition logs bytes, seconds and GB/s at debug
level.

An arena takes the host RAM it needs and no more (verl_npu.engine.host_arena has the layouts and
the reasons): on CUDA one pageable allocation pinned by cudaHostRegister; on Ascend (and any
accelerator without host registration) power-of-two pinned chunks that torch's rounding pinned
allocator gives exactly, a storage split across chunks where it straddles them; on the CPU one
unpinned allocation. ``arena="chunked"`` (or ``VERL_NPU_OFFLOAD_ARENA=chunked``) forces the chunks
anywhere. ``close()`` hands the arenas back and empties torch's pinned-block cache, which would
otherwise keep the freed chunks locked.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from verl_npu.engine.host_arena import CHUNKED, PAGEABLE, REGISTERED, ArenaPlan, choose_strategy, plan_arena

logger = logging.getLogger(__name__)
KINDS = ("params", "grads", "optimizer")
_ALIGN = 512


@dataclasses.dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int


@dataclasses.dataclass
class HostArena:
    """One kind's host memory: ``chunks`` laid out by ``plan`` (one chunk unless ``strategy`` is chunked)."""

    strategy: str
    plan: ArenaPlan
    chunks: list[torch.Tensor]
    pinned: bool
    registered: bool = False  # pinned by cudaHostRegister: unregister before freeing

    @property
    def nbytes(self) -> int:
        """Host bytes the arena holds (for pinned chunks: exactly what torch's allocator locked)."""
        return self.plan.nbytes

    def pieces(self, offset: int, nbytes: int) -> Iterator[tuple[torch.Tensor, slice]]:
        """Arena bytes [offset, offset + nbytes) as (host view, the matching part of the slot), chunk by chunk."""
        for seg in self.plan.segments(offset, nbytes):
            host = self.chunks[seg.chunk][seg.chunk_offset : seg.chunk_offset + seg.nbytes]
            yield host, slice(seg.slot_offset, seg.slot_offset + seg.nbytes)

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """Arena bytes [offset, offset + nbytes) as one uint8 tensor: a view within a chunk, a copy across chunks."""
        parts = [host for host, _ in self.pieces(offset, nbytes)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


MADV_DONTFORK, MADV_DOFORK = 10, 11  # Linux <asm-generic/mman-common.h>


def madvise_pages(tensor: torch.Tensor, advice: int) -> bool:
    """``madvise(advice)`` on the whole pages of ``tensor``'s host bytes; False (logged) where the OS refuses.

    Why a registered arena is MADV_DONTFORK: Linux copies, at fork time, every page a driver holds pinned (sharing
    it copy-on-write would break the device's DMA mapping), so each ``fork()`` of a process with a registered arena
    copied the whole arena: 3.4 s for 8 GiB on the nvidia-h200, 0.012 s once marked (docs/rl_step.md). No child
    process reads the arena; megatron's async checkpoint writer and other libraries fork.
    """
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.nbytes) // page * page
    if end <= start:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, advice) != 0:
        logger.warning("verl-npu offload: madvise(%d) of %d host bytes failed: %s", advice, end - start,
                       os.strerror(ctypes.get_errno()))  # fmt: skip
        return False
    return True


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _optimizers(optimizer: Any) -> Iterator[Any]:
    """The torch optimizers inside megatron's wrappers (ChainedOptimizer -> DistributedOptimizer -> Adam)."""
    if optimizer is None:
        return
    for chained in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(chained, "optimizer", chained)
        yield inner


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    for inner in _optimizers(optimizer):
        for group in inner.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def lazy_adam_state_bytes(optimizer: Any) -> int:
    """Arena bytes of the moments torch's Adam/AdamW will create at their first step for parameters that have no
    state yet (``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``: each the size of its parameter);
    ``step`` is a host scalar, never offloaded."""
    total = 0
    for inner in _optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            moments = 3 if group.get("amsgrad") else 2
            for param in group["params"]:
                if isinstance(param, torch.Tensor) and not inner.state.get(param):
                    total += moments * _aligned(param.nbytes)
    return total


def _ddp_buffers(model_chunks: Iterable[Any]) -> Iterator[Any]:
    """megatron DDP's param/grad buffers; none for an unwrapped module (verl's forward-only models),
    whose ``buffers`` is nn.Module's method, not DDP's list."""
    for chunk in model_chunks:
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = getattr(chunk, name, None)
            if isinstance(buffers, list | tuple):
                yield from buffers


def host_empty_cache_call(device_type: str, accel: Any) -> Callable[[], None] | None:
    """The call that empties the pinned-block cache of ``device_type``'s host allocator, where torch has one."""
    candidates = [getattr(accel, "host_empty_cache", None)]  # torch_npu.npu.host_empty_cache
    accelerator = getattr(torch, "accelerator", None)
    current = getattr(accelerator, "current_accelerator", lambda: None)()
    if current is not None and current.type == device_type:  # the generic calls act on the current accelerator
        candidates.append(getattr(accelerator, "empty_host_cache", None))
        candidates.append(getattr(torch._C, "_accelerator_emptyHostCache", None))
    if device_type == "cuda":
        candidates.append(getattr(torch._C, "_host_emptyCache", None))  # CUDA's host allocator (torch >= 2.5)
    return next((call for call in candidates if callable(call)), None)


class OffloadManager:
    def __init__(
        self,
        model_chunks: Iterable[Any],
        optimizer: Any = None,
        *,
        device: torch.device | str,
        arena: str | None = None,
    ):
        """``arena``: "auto" (the device's strategy) or "chunked"; None reads $VERL_NPU_OFFLOAD_ARENA (default auto)."""
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.arena_strategy = choose_strategy(self.device.type, arena)
        self._accel = torch.get_device_module(self.device.type) if self.device.type != "cpu" else None
        self._stream = self._accel.Stream(device=self.device) if self._accel is not None else None
        self._device_index = None
        if self._accel is not None:
            self._device_index = self.device.index if self.device.index is not None else self._accel.current_device()
        self._pin = self._accel is not None
        self._slots: dict[str, list[_Slot]] = {}
        self._arenas: dict[str, HostArena] = {}
        self._on_host: dict[str, bool] = dict.fromkeys(KINDS, False)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-npu-arena")
        self._pending_arenas: dict[str, concurrent.futures.Future] = {}
        for kind in ("params", "optimizer"):
            self._layout(kind)
            total = self._arena_bytes(kind)
            if kind == "optimizer":
                # Built before the first step, Adam has no moments yet: without room for them the first offload
                # would grow the arena, pinning twice the optimizer's bytes while the step waits.
                lazy = lazy_adam_state_bytes(self.optimizer)
                total = _aligned(total) + lazy if lazy else total
            if total:
                self._pending_arenas[kind] = self._pool.submit(self._allocate_in_background, total)

    # --- what belongs to which kind -------------------------------------------------------------
    def _tensors(self, kind: str) -> list[torch.Tensor]:
        if kind == "grads":
            return [b.grad_data for b in _ddp_buffers(self.model_chunks) if b.grad_data is not None]
        if kind == "params":
            buffers = [b.param_data for b in _ddp_buffers(self.model_chunks) if b.param_data is not None]
            if buffers:
                covered = {_storage_key(t) for t in buffers}
                loose = [p for c in self.model_chunks for p in c.parameters() if _storage_key(p) not in covered]
                return buffers + loose
            return [p for c in self.model_chunks for p in c.parameters()]
        if kind == "optimizer":
            return list(_optimizer_tensors(self.optimizer))
        raise ValueError(f"unknown state kind {kind!r}; kinds: {', '.join(KINDS)}")

    def _layout(self, kind: str) -> list[_Slot]:
        """Unique storages of ``kind`` (excluding storages owned by an earlier kind) and their arena offsets."""
        owned_elsewhere: set[int] = set()
        for other in KINDS:
            if other == kind:
                break
            owned_elsewhere |= {s.storage._cdata for s in self._slots.get(other, [])}
        slots, seen, offset = [], set(), 0
        for tensor in self._tensors(kind):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in seen or key in owned_elsewhere:
                continue
            seen.add(key)
            nbytes = storage.nbytes()
            if nbytes == 0:
                raise RuntimeError(f"{kind}: a storage is already freed; offload state only through this manager")
            slots.append(_Slot(storage, nbytes, offset))
            offset += _aligned(nbytes)
        self._slots[kind] = slots
        return slots

    def _arena_bytes(self, kind: str) -> int:
        slots = self._slots.get(kind, [])
        return slots[-1].offset + slots[-1].nbytes if slots else 0

    # --- host arenas ---------------------------------------------------------------------------
    def _allocate_in_background(self, nbytes: int) -> HostArena:
        if self._accel is not None:
            # the current device is per thread: pin (and create any runtime context) on this manager's device
            self._accel.set_device(self._device_index)
        return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> HostArena:
        if self.arena_strategy == REGISTERED:
            arena = self._register(nbytes)
            if arena is not None:
                return arena
        strategy = PAGEABLE if self.arena_strategy == PAGEABLE else CHUNKED
        plan = plan_arena(strategy, nbytes)
        chunks = [torch.empty(size, dtype=torch.uint8, pin_memory=self._pin) for size in plan.chunk_sizes]
        return HostArena(strategy, plan, chunks, pinned=self._pin)

    def _register(self, nbytes: int) -> HostArena | None:
        """One exact pageable allocation pinned by cudaHostRegister; None when CUDA refuses it."""
        plan = plan_arena(REGISTERED, nbytes)
        if not nbytes:
            return HostArena(REGISTERED, plan, [], pinned=True)
        memory = torch.empty(nbytes, dtype=torch.uint8)
        try:
            status = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes, 0)
            if int(status) == 0:
                madvise_pages(memory, MADV_DONTFORK)
                return HostArena(REGISTERED, plan, [memory], pinned=True, registered=True)
        except (AttributeError, RuntimeError) as exc:  # a torch without the cudart binding
            status = exc
        logger.warning(
            "verl-npu offload: cudaHostRegister of %d bytes failed (%s); using power-of-two pinned chunks",
            nbytes,
            status,
        )
        return None

    def _settled_arena(self, kind: str) -> HostArena | None:
        """The arena of ``kind``, once its background allocation (if one is under way) has finished."""
        pending = self._pending_arenas.pop(kind, None)
        if pending is not None:
            self._arenas[kind] = pending.result()
        return self._arenas.get(kind)

    def _arena(self, kind: str) -> HostArena:
        need = self._arena_bytes(kind)
        arena = self._settled_arena(kind)
        if arena is not None and arena.nbytes < need:
            logger.info("verl-npu offload: %s arena grows from %d to %d bytes", kind, arena.nbytes, need)
            self._release([self._arenas.pop(kind)])
            self._arenas[kind] = self._allocate(need)
            if arena.pinned and not arena.registered:
                self._empty_host_cache()  # the old chunks the new plan did not reuse
        elif arena is None:
            self._arenas[kind] = self._allocate(need)
        return self._arenas[kind]

    def _release(self, arenas: list[HostArena]) -> None:
        """Free the arenas (their device copies must be done); freed pinned chunks go back to torch's cache."""
        for arena in arenas:
            if arena.registered:
                madvise_pages(arena.chunks[0], MADV_DOFORK)  # the allocator may hand these pages out again
                torch.cuda.cudart().cudaHostUnregister(arena.chunks[0].data_ptr())
            arena.chunks.clear()  # also empties an arena a caller still holds (a snapshot): no stale pinning
        # freeing a chunk records an event on each stream that copied it; it stays cached until those complete
        self._wait_side_stream_on_host()

    def _empty_host_cache(self) -> None:
        """Give torch's cached free pinned blocks back to the OS: freed chunks stay locked in that cache until then."""
        call = host_empty_cache_call(self.device.type, self._accel)
        if call is None:
            logger.warning("verl-npu offload: this torch cannot empty the %s pinned-memory cache", self.device.type)
            return
        call()

    # --- transitions ---------------------------------------------------------------------------
    def on_host(self, kind: str) -> bool:
        return self._on_host[kind]

    def host_bytes(self) -> int:
        """Host RAM the arenas hold now: pinned bytes on an accelerator (the chunks' sum where chunked)."""
        return sum(a.nbytes for a in self._arenas.values())

    def _log(self, what: str, kind: str, nbytes: int, started: float) -> None:
        seconds = max(time.perf_counter() - started, 1e-9)
        rate = nbytes / seconds / 1e9
        logger.debug("verl-npu %s %s: %d bytes in %.4f s (%.1f GB/s)", what, kind, nbytes, seconds, rate)

    def _copy_to_arena(self, kind: str) -> list[_Slot]:
        """Copy every storage of ``kind`` into its host arena; returns once the bytes have landed."""
        slots = self._layout(kind)
        arena = self._arena(kind)
        with self._side_stream():
            for slot in slots:
                device_bytes = _bytes_view(slot.storage, self.device)
                for host, part in arena.pieces(slot.offset, slot.nbytes):
                    host.copy_(device_bytes[part], non_blocking=arena.pinned)
        self._wait_side_stream_on_host()
        return slots

    def offload(self, kinds: Iterable[str] = KINDS) -> None:
        for kind in kinds:
            if self._on_host[kind]:
                continue
            started = time.perf_counter()
            if kind == "grads":
                slots = self._layout(kind)
                self._sync_compute()
                for slot in slots:
                    slot.storage.resize_(0)
                self._on_host[kind] = True
                self._log("released", kind, sum(s.nbytes for s in slots), started)
                continue
            slots = self._copy_to_arena(kind)
            for slot in slots:
                slot.storage.resize_(0)
            self._on_host[kind] = True
            self._log("offload", kind, sum(s.nbytes for s in slots), started)

    def onload(self, kinds: Iterable[str] = KINDS) -> None:
        for kind in kinds:
            if not self._on_host[kind]:
                continue
            started = time.perf_counter()
            slots = self._slots[kind]
            for slot in slots:
                slot.storage.resize_(slot.nbytes)
            if kind == "grads":
                for slot in slots:
                    _bytes_view(slot.storage, self.device).zero_()
                self._on_host[kind] = False
                self._log("reallocated", kind, sum(s.nbytes for s in slots), started)
                continue
            arena = self._arenas[kind]
            with self._side_stream():
                for slot in slots:
                    device_bytes = _bytes_view(slot.storage, self.device)
                    for host, part in arena.pieces(slot.offset, slot.nbytes):
                        device_bytes[part].copy_(host, non_blocking=arena.pinned)
            self._compute_waits_for_side_stream()
            self._on_host[kind] = False
            self._log("onload", kind, sum(s.nbytes for s in slots), started)

    @contextlib.contextmanager
    def resident(self, kinds: Iterable[str] = KINDS) -> Iterator[None]:
        """State on the device for the duration (checkpoint save/load), then back where it was."""
        moved = [k for k in kinds if self._on_host[k]]
        self.onload(moved)
        try:
            yield
        finally:
            self.offload(moved)

    def idle_host_regions(self, kinds: Iterable[str] = KINDS) -> list[torch.Tensor]:
        """The host memory of the arenas of ``kinds`` whose state is on the device: bytes nobody reads until the
        next offload of that kind overwrites them (a checkpoint save stages in them, verl_npu.engine.save_staging).
        Arenas not yet allocated are not allocated for it."""
        regions = []
        for kind in kinds:
            if self._on_host[kind]:
                continue
            arena = self._settled_arena(kind)
            if arena is not None:
                regions.extend(arena.chunks)
        return regions

    def snapshot_params_to_host(self) -> HostArena:
        """Copy the parameters into their host arena (a checkpoint snapshot) and return the arena.

        When the parameters are offloaded the arena already holds them: nothing is copied. A slot's
        bytes are ``arena.read(slot.offset, slot.nbytes)``; the arena is emptied by close().
        """
        if self._on_host["params"]:
            return self._arenas["params"]
        started = time.perf_counter()
        slots = self._copy_to_arena("params")
        self._log("snapshot", "params", sum(s.nbytes for s in slots), started)
        return self._arenas["params"]

    # --- streams -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(self._accel.current_stream(self.device))
        with self._accel.stream(self._stream):
            yield

    def _wait_side_stream_on_host(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # the copies must land before the device storage is freed

    def _compute_waits_for_side_stream(self) -> None:
        if self._stream is not None:
            self._accel.current_stream(self.device).wait_stream(self._stream)

    def _sync_compute(self) -> None:
        if self._accel is not None:
            self._accel.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Give the host arenas back (the state must be on the device: onload first), pinned cache included."""
        self._pool.shutdown(wait=True)
        for kind in KINDS:
            if self._on_host[kind]:
                raise RuntimeError(f"close(): {kind} is still offloaded; onload it first")
        arenas = [*self._arenas.values(), *(future.result() for future in self._pending_arenas.values())]
        self._arenas.clear()
        self._pending_arenas.clear()
        self._wait_side_stream_on_host()  # onload's copies read the arenas until they land
        self._release(arenas)
        if any(arena.pinned and not arena.registered for arena in arenas):
            self._empty_host_cache()
