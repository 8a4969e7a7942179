"""Benchmark: what a process's pinned host memory costs each ``fork()`` (issue 31: the checkpoint save's gap).

megatron-core's checkpoint save starts helper processes by ``fork`` (a ``multiprocessing`` manager for its write
results), and so do other libraries a trainer runs. Linux copies at fork time, page by page, the anonymous memory
that a driver holds pinned with ``pin_user_pages`` (its copy-on-write would break the device's DMA mapping):
memory pinned by ``cudaHostRegister``, as verl_npu/engine/offload.py pins its offload arena, is such memory, unless
it is marked ``MADV_DONTFORK``. Memory from ``cudaHostAlloc`` (torch's ``pin_memory=True``) is mapped by the driver
and is not copied.

Each row: the host memory a process holds (allocated and written once), then the wall time of ``fork()`` plus the
child's exit (the child does nothing), the best of ``--repeats``.

    python bench/fork_cost.py --gib 8 --out bench/results/fork_cost_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import mmap
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

MADV_DONTFORK, MADV_DOFORK = 10, 11  # <asm-generic/mman-common.h>


def fork_seconds(repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        best = min(best, time.perf_counter() - started)
    return best


def madvise(tensor: torch.Tensor, advice: int) -> None:
    """``madvise`` on the whole pages inside ``tensor``'s bytes."""
    start = -(-tensor.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (tensor.data_ptr() + tensor.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")


def measure(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    rows = [{"memory": "none", "seconds": fork_seconds(repeats)}]
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    rows.append({"memory": "pageable", "seconds": fork_seconds(repeats)})
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(pageable.data_ptr(), nbytes, 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
        rows.append({"memory": "cudaHostRegister", "seconds": fork_seconds(repeats)})
        madvise(pageable, MADV_DONTFORK)
        rows.append({"memory": "cudaHostRegister + MADV_DONTFORK", "seconds": fork_seconds(repeats)})
        madvise(pageable, MADV_DOFORK)
        cudart.cudaHostUnregister(pageable.data_ptr())
        del pageable
        pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        rows.append({"memory": "cudaHostAlloc (pin_memory=True)", "seconds": fork_seconds(repeats)})
        del pinned
    for row in rows:
        row["bytes"] = 0 if row["memory"] == "none" else nbytes
        row["copied_gb_per_s"] = row["bytes"] / row["seconds"] / 1e9 if row["bytes"] else None
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0, help="host memory held, GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.gib <= 64 or args.repeats < 1:
        parser.error(f"--gib {args.gib} --repeats {args.repeats}: give 0 < GiB <= 64 and at least one repeat")
    rows = measure(int(args.gib * (1 << 30)), args.repeats)
    result = {
        "benchmark": "fork_cost", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release()},
        "repeats": args.repeats, "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"fork() with {args.gib:g} GiB of host memory held ({result['device']})")
    for column in ("memory", "fork + exit, s"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["memory"], f"{row['seconds']:.4f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
