"""Write a file whole or not at all: a temporary file beside it, fsync, rename.

A full disk, a killed process or two writers at once never leave a truncated file where a baseline
or a cache entry was: the old file stays until the new one is complete. The temporary name is
unique per call (``tempfile.mkstemp``), so two processes (ranks, parallel preflights) writing the
same file never share one temporary file; the last rename wins, whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

CHUNK = 1 << 16


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:CHUNK])
        view = view[written:]


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically; raises OSError (the old file intact) when it cannot."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o7777  # keep a tracked file's mode (mkstemp's is 0600)
    except OSError:
        mode = 0o666 & ~_umask()
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def writable_directory(path: str | os.PathLike[str]) -> str | None:
    """None when a file can be written into the directory of ``path``; else why not (for a message)."""
    parent = Path(path).parent
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None
