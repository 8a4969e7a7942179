"""Offload manager: moves a Megatron model's state between the accelerator and one host arena per kind.

Kinds: ``params`` (DDP parameter buffers, or the parameters themselves without the distributed
optimizer), ``grads`` (DDP gradient buffers: freed, never copied, zeroed on reload as Megatron
expects) and ``optimizer`` (every tensor the optimizer holds: fp32 main parameters and every state
entry whatever its key and dtype, e.g. exp_avg, exp_avg_sq, int16 master_param remainders).

It works on storages, not tensors: every view (a parameter inside a DDP buffer, a main-grad view,
a distributed-optimizer shard that aliases a model parameter) stays valid, each storage is copied
once even when several kinds reference it, and the bytes round-trip exactly. Each kind has one host
arena, pinned where the platform has pinned memory, allocated once (in the background from
construction, so the first offload does not pay for it) and reused: host memory never holds two
copies of the same state. Copies run on a side stream; onload makes the compute stream wait for
them instead of blocking the host. Each transition logs bytes, seconds and GB/s at debug level.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)
KINDS = ("params", "grads", "optimizer")
_ALIGN = 512


@dataclasses.dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int


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


def _ddp_buffers(model_chunks: Iterable[Any]) -> Iterator[Any]:
    """megatron DDP's param/grad buffers; none for an unwrapped module (verl's forward-only models),
    whose ``buffers`` is nn.Module's method, not DDP's list."""
    for chunk in model_chunks:
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = getattr(chunk, name, None)
            if isinstance(buffers, list | tuple):
                yield from buffers


class OffloadManager:
    def __init__(self, model_chunks: Iterable[Any], optimizer: Any = None, *, device: torch.device | str):
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        self.device = torch.device(device)
        self._accel = torch.get_device_module(self.device.type) if self.device.type != "cpu" else None
        self._stream = self._accel.Stream(device=self.device) if self._accel is not None else None
        self._pin = self._accel is not None
        self._slots: dict[str, list[_Slot]] = {}
        self._arenas: dict[str, torch.Tensor] = {}
        self._on_host: dict[str, bool] = dict.fromkeys(KINDS, False)
        self._registered: list[torch.Tensor] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-npu-arena")
        self._pending_arenas: dict[str, concurrent.futures.Future] = {}
        for kind in ("params", "optimizer"):
            self._layout(kind)
            total = self._arena_bytes(kind)
            if total:
                self._pending_arenas[kind] = self._pool.submit(self._allocate, total)

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
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self._slots[kind] = slots
        return slots

    def _arena_bytes(self, kind: str) -> int:
        slots = self._slots.get(kind, [])
        return slots[-1].offset + slots[-1].nbytes if slots else 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            # torch's pinned allocator rounds every block up to a power of two (an 8.8 GB arena would
            # lock 16 GB); registering an exact pageable allocation pins exactly what we use.
            arena = torch.empty(nbytes, dtype=torch.uint8)
            if torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), nbytes, 0) == 0:
                self._registered.append(arena)
                return arena
            logger.warning(
                "verl-npu offload: cudaHostRegister of %d bytes failed; using torch's pinned allocator", nbytes
            )
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def _arena(self, kind: str) -> torch.Tensor:
        need = self._arena_bytes(kind)
        pending = self._pending_arenas.pop(kind, None)
        if pending is not None:
            self._arenas[kind] = pending.result()
        arena = self._arenas.get(kind)
        if arena is None or arena.numel() < need:
            if arena is not None:
                logger.info("verl-npu offload: %s arena grows from %d to %d bytes", kind, arena.numel(), need)
                self._release(self._arenas.pop(kind))
            self._arenas[kind] = arena = self._allocate(need)
        return arena

    # --- transitions ---------------------------------------------------------------------------
    def on_host(self, kind: str) -> bool:
        return self._on_host[kind]

    def host_bytes(self) -> int:
        return sum(a.numel() for a in self._arenas.values())

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
                arena[slot.offset : slot.offset + slot.nbytes].copy_(
                    _bytes_view(slot.storage, self.device), non_blocking=self._pin
                )
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
                    _bytes_view(slot.storage, self.device).copy_(
                        arena[slot.offset : slot.offset + slot.nbytes], non_blocking=self._pin
                    )
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

    def snapshot_params_to_host(self) -> torch.Tensor:
        """Copy the parameters into their host arena (a checkpoint snapshot) and return the arena.

        When the parameters are offloaded the arena already holds them: nothing is copied.
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

    def _release(self, arena: torch.Tensor) -> None:
        if any(arena is registered for registered in self._registered):
            torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
            self._registered = [r for r in self._registered if r is not arena]

    def close(self) -> None:
        """Give the host arenas back (the state must be on the device: onload first)."""
        self._pool.shutdown(wait=True)
        for kind in KINDS:
            if self._on_host[kind]:
                raise RuntimeError(f"close(): {kind} is still offloaded; onload it first")
        arenas = [*self._arenas.values(), *(future.result() for future in self._pending_arenas.values())]
        for arena in arenas:
            self._release(arena)
        self._arenas.clear()
        self._pending_arenas.clear()
