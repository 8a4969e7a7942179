"""Run a one-rank script on ``world`` local gloo ranks and collect what each rank left (the parallel CPU tests).

The script takes ``RANK WORLD PORT WORKDIR [flags...]`` and writes ``WORKDIR/rank<R>-of-<WORLD>.pt`` (its result,
``torch.save``) or ``.error`` (its traceback).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


def run_ranks(script: Path, workdir: Path, world: int, *flags: str, timeout: float = 600) -> dict[int, dict]:
    """Each rank's result, or ``{"error": ...}``; one rank's error stops the others (they would wait for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(port), str(workdir), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any((workdir / f"rank{r}-of-{world}.error").exists() for r in range(world)):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    results = {}
    for rank, proc in enumerate(procs):
        error, result = workdir / f"rank{rank}-of-{world}.error", workdir / f"rank{rank}-of-{world}.pt"
        if error.exists():
            results[rank] = {"error": error.read_text()}
        elif result.exists():
            results[rank] = torch.load(result)
        else:
            results[rank] = {"error": f"rank {rank} left no result:\n{proc.stdout.read()[-3000:]}"}
    return results


def rank_entry(
    main: Callable[[argparse.Namespace], None], add_flags: Callable[[argparse.ArgumentParser], None] | None = None
) -> None:
    """A rank script's ``__main__``: parse ``RANK WORLD PORT WORKDIR`` (and the script's flags), run ``main(args)``,
    and leave the traceback as ``WORKDIR/rank<R>-of-<WORLD>.error`` when it raises (run_ranks stops the others)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("workdir", type=Path)
    if add_flags is not None:
        add_flags(parser)
    args = parser.parse_args()
    try:
        main(args)
    except Exception:
        (args.workdir / f"rank{args.rank}-of-{args.world}.error").write_text(traceback.format_exc())
        raise
