"""Reading an HF safetensors checkpoint at the disk's rate: large reads on several threads, tensors as views.

mbridge 0.15.1's ``SafeTensorIO.load_some_hf_weight`` opens each file with ``safe_open`` and copies the tensors out
one by one from a memory map: page faults of one thread, 4 KiB at a time unless the kernel's readahead keeps up, and
a copy of every byte. Measured on the nvidia-h200 (bench/rl_step.py, docs/rl_step.md): the HF load of a 3.1 GB
model ran at 39% of that machine's sequential disk rate. Here each file's requested byte span is read with
``os.preadv`` in chunks of ``CHUNK_BYTES`` by ``READ_THREADS`` threads straight into one host buffer, and every
tensor is a view of that buffer (no second copy); a buffer is freed when its last tensor is. :class:`TensorReads`
reads each tensor on its own instead, in the order a load takes them, so that the load converts and copies one to
the device while the next are read (verl_npu/engine/bridges/fast_load.py).

Every header is checked before a byte is trusted: its length, that it is JSON of tensor entries, a known dtype,
offsets inside the file that match the shape and the dtype's size. A bad file is refused naming the file and the
tensor. The values are the bytes on disk, exactly what ``safe_open`` gives (tests_npu/engine/test_fast_load.py).

:func:`prefetch` starts those per-tensor reads when the engine starts, so that the disk works while the model is
built (verl_npu/engine/verl_engine.py); the load claims them, done or in flight, and reads nothing twice.

Remove when mbridge reads in large parallel chunks (its ``SafeTensorIO`` as of mbridge 0.15.1).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from mbridge.core.safetensor_io import SafeTensorIO

from verl_npu import safetensors_header
from verl_npu.safetensors_header import CheckpointFileError

logger = logging.getLogger(__name__)
CHUNK_BYTES = 64 << 20
READ_THREADS = 8
COPY_THREADS = 4  # host-to-device copies of a load in flight (TensorReads)
COPY_AHEAD_BYTES = 1 << 30  # device memory the copies may run ahead of the load by
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """(name -> {"dtype": a torch dtype, "shape", "offsets"}, the data section's start): the header checked against
    the file's size (verl_npu.safetensors_header)."""
    entries, start = safetensors_header.read_header(path)
    return {name: {**entry, "dtype": DTYPES[entry["dtype"]]} for name, entry in entries.items()}, start


def _read_span(path: Path, start: int, nbytes: int, threads: int) -> torch.Tensor:
    """Bytes [start, start + nbytes) of ``path`` in one uint8 tensor, read in parallel chunks."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return buffer
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:

        def read_chunk(offset: int) -> None:
            end = min(offset + CHUNK_BYTES, nbytes)
            while offset < end:
                got = os.preadv(fd, [view[offset:end]], start + offset)
                if got == 0:
                    raise CheckpointFileError(f"{path}: ended at byte {start + offset}, expected {start + nbytes}")
                offset += got

        chunks = range(0, nbytes, CHUNK_BYTES)
        if len(chunks) == 1 or threads <= 1:
            for offset in chunks:
                read_chunk(offset)
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(threads, len(chunks))) as pool:
                list(pool.map(read_chunk, chunks))
    finally:
        os.close(fd)
    return buffer


def read_tensors(path: str | os.PathLike, names: Iterable[str], threads: int = READ_THREADS) -> dict[str, torch.Tensor]:
    """The named tensors of one safetensors file, as views of one buffer holding the span that covers them."""
    path = Path(path)
    entries, start = read_header(path)
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise CheckpointFileError(f"{path}: no tensor {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if not wanted:
        return {}
    first = min(entries[n]["offsets"][0] for n in wanted)
    last = max(entries[n]["offsets"][1] for n in wanted)
    buffer = _read_span(path, start + first, last - first, threads)
    out = {}
    for name in wanted:
        entry = entries[name]
        begin, end = entry["offsets"]
        raw = buffer[begin - first : end - first]
        if (begin - first) % entry["dtype"].itemsize:
            raw = raw.clone()  # safetensors does not promise aligned tensors; a view must be
        out[name] = raw.view(entry["dtype"]).view(entry["shape"])
    return out


def file_of_each_name(hf_dir: str | os.PathLike, index: dict[str, str] | None) -> dict[str, str]:
    """name -> file name, from the index's weight map, else from every ``*.safetensors`` file's header."""
    if index:
        return dict(index)
    out: dict[str, str] = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        for name in read_header(file)[0]:
            out.setdefault(name, file.name)
    return out


class ParallelSafeTensorIO(SafeTensorIO):
    """mbridge's reader, with ``load_some_hf_weight`` through :func:`read_tensors`: the files at once, each name
    once, the files' own headers where there is no index."""

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        return read_as_stored(self, hf_weight_names)


def file_of_name(reader: SafeTensorIO) -> dict[str, str]:
    """name -> file of ``reader``'s checkpoint (any mbridge reader), worked out once per reader."""
    cached = reader.__dict__.get("_file_of_name")
    if cached is None:
        cached = reader.__dict__["_file_of_name"] = file_of_each_name(reader.hf_dir, reader.index)
    return cached


def read_as_stored(reader: SafeTensorIO, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors of ``reader``'s checkpoint as stored (FP8 codes stay codes): every file at once, each on
    its share of READ_THREADS."""
    file_of = file_of_name(reader)
    by_file: dict[str, list[str]] = defaultdict(list)
    missing: list[str] = []
    for name in dict.fromkeys(names):
        (by_file[file_of[name]] if name in file_of else missing).append(name)
    if missing:
        raise ValueError(f"Weights {missing[:5]} not found in safetensors files in {reader.hf_dir}")
    if not by_file:
        return {}
    threads = max(1, READ_THREADS // len(by_file))
    out: dict[str, torch.Tensor] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(by_file), READ_THREADS)) as pool:
        files = [pool.submit(read_tensors, os.path.join(reader.hf_dir, f), ns, threads) for f, ns in by_file.items()]
        for done in files:
            out.update(done.result())
    return out


def _use_device(device: torch.device) -> None:
    """Make ``device`` this thread's current one: a new thread starts on device 0 of the runtime (CUDA's and
    torch_npu's current device is per thread), where its copies' staging and any runtime context would go."""
    if device.type != "cpu" and device.index is not None:
        torch.get_device_module(device.type).set_device(device.index)


class _DeviceCopies:
    """Copies of the read tensors to the device on COPY_THREADS threads, issued in load order, at most
    COPY_AHEAD_BYTES of them not yet taken (one larger tensor alone): a copy from pageable host memory runs at a few
    GB/s on one thread, slower than the disk once the reads are ahead of the load. Room is granted strictly in
    ticket (load) order, and a tensor the load asks for gets it at once with every earlier one, so the load never
    waits on room that only its own later takes would free."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = concurrent.futures.ThreadPoolExecutor(
            COPY_THREADS, thread_name_prefix="verl-npu-copy", initializer=_use_device, initargs=(device,)
        )
        self._room = threading.Condition()
        self._next_ticket = 0  # the next copy to get room
        self._tickets = 0
        self._wanted = -1  # the latest ticket the load has asked for
        self._ahead = 0  # bytes copied (or being copied) and not yet taken
        self._closed = False

    def submit(self, read: concurrent.futures.Future, entry: dict) -> tuple[int, concurrent.futures.Future]:
        ticket, self._tickets = self._tickets, self._tickets + 1
        return ticket, self._pool.submit(self._copy, ticket, read, entry)

    def _copy(self, ticket: int, read: concurrent.futures.Future, entry: dict) -> torch.Tensor | None:
        nbytes = entry["offsets"][1] - entry["offsets"][0]
        with self._room:
            while not self._closed and not (
                self._next_ticket == ticket
                and (ticket <= self._wanted or self._ahead == 0 or self._ahead + nbytes <= COPY_AHEAD_BYTES)
            ):
                self._room.wait()
            if self._closed:
                return None
            self._next_ticket += 1
            self._ahead += nbytes
            self._room.notify_all()
        try:
            return read.result().view(entry["dtype"]).view(entry["shape"]).to(self.device)
        except BaseException:
            self.taken(nbytes)
            raise

    def want(self, ticket: int) -> None:
        with self._room:
            if ticket > self._wanted:
                self._wanted = ticket
                self._room.notify_all()

    def taken(self, nbytes: int) -> None:
        with self._room:
            self._ahead -= nbytes
            self._room.notify_all()

    def close(self) -> None:
        with self._room:
            self._closed = True
            self._room.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)


class TensorReads:
    """The named tensors of ``reader``'s checkpoint, each read as its own task in the order given on READ_THREADS
    threads, each taken as soon as its bytes are in: a load that takes them in that order copies one tensor to the
    device while the next ones are read. A tensor taken ``uses`` times (default once) is then let go. A read that a
    :func:`prefetch` of the checkpoint has begun is claimed from it instead of issued again. With ``device``, the
    tensors are taken there, copied by :class:`_DeviceCopies` ahead of the load.

    Use as a context manager: leaving it waits for the reads in flight and drops those not taken."""

    def __init__(
        self,
        reader: SafeTensorIO,
        names: Iterable[str],
        uses: dict[str, int] | None = None,
        device: torch.device | None = None,
    ):
        file_of = file_of_name(reader)
        wanted = list(dict.fromkeys(names))
        missing = [n for n in wanted if n not in file_of]
        if missing:
            raise ValueError(f"Weights {missing[:5]} not found in safetensors files in {reader.hf_dir}")
        self._uses = {n: (uses or {}).get(n, 1) for n in wanted}
        headers: dict[str, tuple[dict[str, dict], int]] = {}
        plan = []  # every header checked before the first read starts
        for name in wanted:
            path = os.path.join(reader.hf_dir, file_of[name])
            if path not in headers:
                headers[path] = read_header(path)
            entries, start = headers[path]
            if name not in entries:
                raise CheckpointFileError(f"{path}: no tensor {name!r} (the index names this file)")
            plan.append((name, path, start, entries[name]))
        self.nbytes = sum(e["offsets"][1] - e["offsets"][0] for *_, e in plan)  # the named tensors' bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="verl-npu-read")
        self._copies = _DeviceCopies(device) if device is not None else None
        # name -> (its read, its header entry, (copier, ticket) until its first take when copied to the device)
        self._reads: dict[str, tuple[concurrent.futures.Future, dict, tuple[_DeviceCopies, int] | None]] = {}
        for name, path, start, entry in plan:
            begin, end = entry["offsets"]
            # one thread per tensor: the pool's threads read several tensors at once
            future = _claim_prefetched(path, name, start + begin, end - begin)
            if future is None:
                future = self._pool.submit(_read_span, Path(path), start + begin, end - begin, 1)
            copy = None
            if self._copies is not None:
                ticket, future = self._copies.submit(future, entry)
                copy = (self._copies, ticket)
            self._reads[name] = (future, entry, copy)

    def take(self, name: str) -> torch.Tensor:
        future, entry, copy = self._reads[name]
        if copy is not None:
            copies, ticket = copy
            copies.want(ticket)
        tensor = future.result().view(entry["dtype"]).view(entry["shape"])
        if copy is not None:  # its first take: the load holds it from now on
            self._reads[name] = (future, entry, None)
            copy[0].taken(entry["offsets"][1] - entry["offsets"][0])
        self._uses[name] -= 1
        if self._uses[name] <= 0:
            del self._reads[name]
        return tensor

    def __contains__(self, name: str) -> bool:
        return name in self._reads

    def __enter__(self) -> TensorReads:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._copies is not None:
            self._copies.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()


PREFETCH_SHARE_OF_AVAILABLE = 0.5  # prefetch only a checkpoint smaller than this share of the memory available


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def unloaded_layers(hf_config) -> Callable[[str], bool]:
    """Whether a tensor name belongs to a decoder layer the model does not build: the MTP layers a checkpoint stores
    after its ``num_hidden_layers`` (GLM-5, DeepSeek-V3), beyond the ``num_nextn_predict_layers`` the run trains
    (verl zeroes it unless MTP is on)."""
    built = hf_config.num_hidden_layers + (getattr(hf_config, "num_nextn_predict_layers", 0) or 0)

    def unloaded(name: str) -> bool:
        match = _LAYER.match(name)
        return match is not None and int(match[1]) >= built

    return unloaded


def _identity(path: str) -> tuple[int, int, int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class Prefetch:
    """Reads of a checkpoint's tensors begun before any load asks for them (:func:`prefetch`): each tensor its own
    read, in file order, READ_THREADS at a time. A load's :class:`TensorReads` claims the reads it needs, done or in
    flight, so the disk reads no byte twice and works while the model is built; :meth:`close` drops the rest."""

    def __init__(self, hf_dir: str, plan: list[tuple[str, str, int, int]]):
        self.hf_dir = hf_dir
        self.nbytes = sum(nbytes for *_, nbytes in plan)
        self.claimed_bytes = 0
        self._identity = {path: _identity(path) for path in dict.fromkeys(path for path, *_ in plan)}
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._unfinished = len(plan)
        self._pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="verl-npu-prefetch")
        self._reads: dict[tuple[str, str], tuple[int, int, concurrent.futures.Future]] = {}
        for path, name, offset, nbytes in plan:
            future = self._pool.submit(_read_span, Path(path), offset, nbytes, 1)
            self._reads[(path, name)] = (offset, nbytes, future)
            future.add_done_callback(self._finished)

    def _finished(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._unfinished -= 1
            last = self._unfinished == 0
        if last:
            seconds = time.perf_counter() - self._started
            logger.info("verl-npu: prefetched %s (%d bytes) in %.2f s, %.2f GB/s", self.hf_dir, self.nbytes, seconds,
                        self.nbytes / max(seconds, 1e-9) / 1e9)  # fmt: skip

    def claim(self, path: str, name: str, offset: int, nbytes: int) -> concurrent.futures.Future | None:
        """The read of these bytes of ``path`` (a real path), now the caller's; None where it was not prefetched
        or the file changed since (then the caller reads it itself)."""
        with self._lock:
            read = self._reads.get((path, name))
            if read is None or read[:2] != (offset, nbytes):
                return None
            del self._reads[(path, name)]
        if _identity(path) != self._identity[path]:
            read[2].cancel()
            logger.warning("verl-npu: %s changed since it was prefetched: read again", path)
            return None
        with self._lock:
            self.claimed_bytes += nbytes
        return read[2]

    def close(self) -> None:
        """Drop the reads no load claimed (the queued ones are not started) and forget this prefetch."""
        with self._lock:
            unclaimed, self._reads = self._reads, {}
        for *_, future in unclaimed.values():
            future.cancel()
        self._pool.shutdown(wait=False)
        with _PREFETCHES_LOCK:
            if self in _PREFETCHES:
                _PREFETCHES.remove(self)
        logger.info("verl-npu: prefetch of %s closed: %d of its %d bytes claimed by the load", self.hf_dir,
                    self.claimed_bytes, self.nbytes)  # fmt: skip


_PREFETCHES: list[Prefetch] = []
_PREFETCHES_LOCK = threading.Lock()


def _claim_prefetched(path: str, name: str, offset: int, nbytes: int) -> concurrent.futures.Future | None:
    with _PREFETCHES_LOCK:
        prefetches = list(_PREFETCHES)
    real = os.path.realpath(path)
    for prefetch in prefetches:
        if (future := prefetch.claim(real, name, offset, nbytes)) is not None:
            return future
    return None


def _plan(hf_dir: str, skip: Callable[[str], bool] | None) -> list[tuple[str, str, int, int]]:
    """(real path, name, offset, bytes) of every tensor the checkpoint's index (else its ``*.safetensors`` files)
    names and ``skip`` does not, in file order."""
    index_file = Path(hf_dir) / "model.safetensors.index.json"
    if index_file.exists():
        with open(index_file) as f:
            index = json.load(f)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointFileError(f"{index_file}: no weight_map object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, sorted(f.name for f in Path(hf_dir).glob("*.safetensors"))
    plan = []
    for file in files:
        path = os.path.realpath(os.path.join(hf_dir, file))
        entries, start = read_header(path)
        tensors = [
            (path, name, start + entry["offsets"][0], entry["offsets"][1] - entry["offsets"][0])
            for name, entry in entries.items()
            if (weight_map is None or weight_map.get(name) == file) and not (skip and skip(name))
        ]
        plan.extend(sorted(tensors, key=lambda t: t[2]))
    return plan


def prefetch(hf_dir: str | os.PathLike, skip: Callable[[str], bool] | None = None) -> Prefetch | None:
    """Start reading the checkpoint's tensors (but those ``skip`` names: :func:`unloaded_layers`) into host memory,
    for the load that follows the model's build to claim (:class:`TensorReads`). One process per node does it
    (``LOCAL_RANK`` 0, or a process without one: what it reads also warms the node's page cache for the others), and
    only for tensors under PREFETCH_SHARE_OF_AVAILABLE of the memory available; the engine asks only where that
    process loads the whole checkpoint itself (verl_engine.loads_whole_checkpoint). The caller closes it after the
    load. None where it does not run."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    hf_dir = str(hf_dir)
    try:
        plan = _plan(hf_dir, skip)
    except (OSError, ValueError) as exc:  # the load reports it, naming the file; a prefetch is only a head start
        logger.info("verl-npu: checkpoint %s not prefetched: %s", hf_dir, exc)
        return None
    total, available = sum(nbytes for *_, nbytes in plan), _available_bytes()
    if not plan or available is None or total > PREFETCH_SHARE_OF_AVAILABLE * available:
        logger.info("verl-npu: checkpoint %s (%d bytes) not prefetched: %s bytes available", hf_dir, total, available)
        return None
    started = Prefetch(hf_dir, plan)
    with _PREFETCHES_LOCK:
        _PREFETCHES.append(started)
    return started
