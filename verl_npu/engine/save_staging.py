"""A synchronous checkpoint save stages its device-to-host copies in the offload manager's idle host arenas.

What it changes: megatron-core 0.18's ``FileSystemWriterAsync.preload_tensors``
(megatron/core/dist_checkpointing/strategies/filesystem_async.py), the step of every torch_dist save that copies
each tensor to the host (``tensor.to("cpu", non_blocking=True)``: pinned blocks from torch's caching host
allocator). Inside :func:`staged_in`, each tensor is copied into the next free bytes of the regions given instead,
as its own storage of exactly its bytes (the torch_dist writer saves a tensor's whole storage, so a view of a larger
one would write all of it); a tensor that no longer fits, or is not contiguous, goes megatron's way. The bytes
written are the same.

Why: the engine's offload arenas hold a host copy of the parameters and the optimizer only while those are
offloaded; while the state is on the device, as it is during a save, the arenas are idle. megatron's copies pinned
the optimizer's bytes a second time instead: on the nvidia-h200 the first save of a 1.5B model spent 11.3 s pinning
18.5 GB (verl's engine 0.34 s: its optimizer offload had left blocks of those sizes in torch's cache), and those
blocks then stay locked beside the arenas, twice the state in pinned host memory (docs/rl_step.md).

Scope: synchronous saves only (an asynchronous one writes after ``save_checkpoint`` returns, while the arenas are
needed again); regions the caller knows to be idle until the block ends.

Remove when megatron's writer takes a staging buffer from its caller, or the engine no longer keeps host arenas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import threading
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)
EXPECTED_PARAMETERS = ("write_buckets", "non_blocking")
_ALIGN = 512
_active = threading.Lock()


@dataclasses.dataclass
class StagingStats:
    """What one save staged: bytes in the regions, bytes megatron's way (tensors that did not fit or were strided)."""

    staged_bytes: int = 0
    staged_tensors: int = 0
    megatron_bytes: int = 0
    megatron_tensors: int = 0


class _Regions:
    """First fit over host byte regions; each piece is a tensor owning exactly its bytes, 512-byte aligned."""

    def __init__(self, regions: list[torch.Tensor]):
        self._regions = [r for r in regions if r.numel()]
        self._used = [0] * len(self._regions)

    def take(self, nbytes: int) -> torch.Tensor | None:
        for index, region in enumerate(self._regions):
            base = region.data_ptr()
            start = -(-(base + self._used[index]) // _ALIGN) * _ALIGN - base
            if start + nbytes <= region.numel():
                self._used[index] = start + nbytes
                # frombuffer: a storage of exactly these bytes (a slice would carry the whole region's storage)
                return torch.frombuffer(memoryview(region[start : start + nbytes].numpy()), dtype=torch.uint8)
        return None


def _writer_class():
    """megatron's writer, after checking that its preload step is still the one this module replaces."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    found = inspect.getattr_static(FileSystemWriterAsync, "preload_tensors", None)
    parameters = tuple(inspect.signature(found.__func__).parameters) if isinstance(found, staticmethod) else None
    if parameters != EXPECTED_PARAMETERS:
        raise RuntimeError(
            "verl-npu save staging: megatron-core's FileSystemWriterAsync.preload_tensors has drifted: expected a "
            f"staticmethod{EXPECTED_PARAMETERS}, found {found!r} with parameters {parameters}. Update "
            "verl_npu/engine/save_staging.py for this megatron-core, or pin the stack's version."
        )
    return FileSystemWriterAsync, found


def _preload_into(regions: _Regions, stats: StagingStats, original):
    def preload_tensors(write_buckets, non_blocking=True):
        staged_buckets, devices = [], set()
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            staged = []
            for item, tensor in tensor_data:
                host = regions.take(tensor.nbytes) if tensor.is_contiguous() and tensor.nbytes else None
                if host is None:
                    staged.append((item, tensor.to("cpu", non_blocking=non_blocking)))
                    stats.megatron_bytes += tensor.nbytes
                    stats.megatron_tensors += 1
                else:
                    out = host.view(tensor.dtype).view(tensor.shape)
                    out.copy_(tensor, non_blocking=non_blocking)
                    staged.append((item, out))
                    stats.staged_bytes += tensor.nbytes
                    stats.staged_tensors += 1
                devices.add(tensor.device)
                del tensor
            staged_buckets.append((file_name, storage_key, (bytes_data, staged)))
        for device in devices:  # megatron synchronises CUDA only; the copies may be on any accelerator
            if device.type != "cpu":
                torch.get_device_module(device.type).synchronize(device)
        return staged_buckets

    preload_tensors.__wrapped__ = original.__func__
    return preload_tensors


@contextlib.contextmanager
def staged_in(regions: list[torch.Tensor]) -> Iterator[StagingStats]:
    """For the block: megatron's save copies land in ``regions`` (uint8 host tensors, idle for the whole block).
    With no region, nothing changes. Not re-entrant: the patch is process-wide."""
    stats = StagingStats()
    if not regions:
        yield stats
        return
    writer, original = _writer_class()
    if not _active.acquire(blocking=False):
        raise RuntimeError("verl-npu save staging: a save is already staged in this process; saves do not nest")
    try:
        writer.preload_tensors = staticmethod(_preload_into(_Regions(regions), stats, original))
        yield stats
    finally:
        writer.preload_tensors = original
        _active.release()
    logger.info(
        "verl-npu save: %d bytes (%d tensors) staged in the offload arena, %d bytes (%d tensors) megatron's way",
        stats.staged_bytes, stats.staged_tensors, stats.megatron_bytes, stats.megatron_tensors,
    )  # fmt: skip
