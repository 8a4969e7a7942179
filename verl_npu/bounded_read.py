"""Reading a file named from outside: regular files only, never blocking, never more than a size cap.

A path from a launch, an option or a config may name a FIFO (reading it blocks until someone writes), a terminal,
``/dev/stdin``, a device that never ends (``/dev/zero``) or a file far larger than any config. :func:`read_bytes`
opens without blocking, checks the open descriptor (no race with a file swapped in between), refuses what is not a
regular file or is over ``limit`` bytes, and turns every failure into :class:`NotReadable`, whose message says why.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

MIB = 1 << 20


class NotReadable(OSError):
    """A file that is not read: missing, not a regular file, over the size cap, or failing to read."""


def read_bytes(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them; raises NotReadable."""
    name = os.fspath(path)
    if "\0" in name:
        raise NotReadable("the path holds a NUL byte")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        mode = stat.S_IFREG
        with contextlib.suppress(OSError):  # a socket cannot be opened at all: name what it is
            mode = os.stat(name).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise NotReadable(f"not a regular file but {file_kind(mode)}") from None
        raise NotReadable(exc.strerror or str(exc)) from None
    except ValueError as exc:  # a path the OS cannot take at all
        raise NotReadable(str(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotReadable(
                f"not a regular file but {file_kind(info.st_mode)} (a pipe, device or terminal is never read: it may "
                "block)"
            )
        if info.st_size > limit:
            raise NotReadable(f"larger than {_size(limit)} ({info.st_size} bytes)")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 16):
            total += len(chunk)
            if total > limit:  # it grew while being read
                raise NotReadable(f"larger than {_size(limit)}")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        if isinstance(exc, NotReadable):
            raise
        raise NotReadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, for a message: "a directory", "a FIFO", ..."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def read_text(path: str | os.PathLike[str], limit: int) -> str:
    """:func:`read_bytes` decoded as UTF-8; raises NotReadable for bytes that are not UTF-8."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotReadable(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def expand_user(path: str) -> Path:
    """``Path(path).expanduser()``, or NotReadable for ``~user`` that names no user (Path raises RuntimeError)."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:
        raise NotReadable(f"{path}: {exc}") from None


def _size(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit >= MIB else f"{limit} bytes"
