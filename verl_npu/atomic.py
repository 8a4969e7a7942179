"""The one writer of every file verl-npu writes: whole or not at all, and only ever a regular file.

Whole or not at all: a temporary file beside the target, fsync, rename. A full disk, a killed process
or two writers at once never leave a truncated file where a baseline or a cache entry was: the old
file stays until the new one is complete. The temporary name is unique per call
(``tempfile.mkstemp``), so two processes (ranks, parallel preflights) writing the same file never
share one temporary file; the last rename wins, whole.

Only a regular file: a rename replaces whatever has the name, so the target is checked first. A
symlink is written through (the new file replaces the regular file at the end of the chain, and the
link stays a link); a dangling symlink creates its target, as ``open(path, "w")`` would. A
directory, device, FIFO or socket, at the path or at the end of its links, is refused with
:class:`OutputPathError` (the CLI's exit 2, docs/errors.md "Output paths") and never opened: a
FIFO would block, and replacing ``/dev/full`` as root replaces the machine's device.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from verl_npu.bounded_read import file_kind
from verl_npu.errors import UserError

CHUNK = 1 << 16

NOT_REPLACED = (
    "a directory, device, FIFO or socket is never written or replaced: give the path of a regular file or of a new one"
)


class OutputPathError(UserError):
    """A file cannot be written at this path (what is there is not a regular file, or its directory is not
    usable); nothing was written and nothing was replaced."""


def _kind(mode: int) -> str:
    """bounded_read's name of a kind, a FIFO spelt out for a writer, and a symlink (seen by the lstat before the
    rename)."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    return "a symlink" if stat.S_ISLNK(mode) else file_kind(mode)


def _through_proc(path: Path) -> bool:
    """Whether a link of ``path``'s chain is one of /proc's links to an open file (/dev/stdout, /dev/fd/N)."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a chain (ELOOP)
        if os.path.realpath(os.path.dirname(current)).startswith("/proc/"):
            return True
        try:
            target = os.readlink(current)
        except OSError:
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), target))
    return False


def _resolve(path: Path) -> tuple[Path, os.stat_result | None, str | None]:
    """(the file a write to ``path`` replaces or creates, its stat when it exists, why it cannot be written).

    The why names what is there and how to fix it, without the path itself (callers put it in front)."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # the directory checks below say which part is missing
        is_link = False
    except OSError as exc:
        return path, None, f"it cannot be looked up ({exc.strerror or exc})"
    final = Path(os.path.realpath(path)) if is_link else path
    via = f"a symlink to {final}, which is " if is_link else ""
    try:
        found = os.stat(path)  # follows the whole chain, /proc's links to pipes and terminals included
    except (FileNotFoundError, NotADirectoryError):
        found = None  # nothing there, or a dangling link: the write creates the file
    except OSError as exc:  # ELOOP
        return final, None, f"it is a symlink that does not resolve ({exc.strerror or exc})"
    if found is not None and not stat.S_ISREG(found.st_mode):
        return final, found, f"it is {via}{_kind(found.st_mode)}; {NOT_REPLACED}"
    if is_link and _through_proc(path):  # /dev/stdout redirected to a file: a rename would swap the shell's file
        why = (f"it is a link to {final}, a file a process holds open (as /dev/stdout is): the output would replace "
               "that file under the process, not add to it; give the file's own path, or a new one")  # fmt: skip
        return final, found, why
    parent = final.parent
    prefix = f"it is a symlink to {final}; " if is_link else ""
    if not parent.exists():
        return final, found, f"{prefix}directory {parent} does not exist"
    if not parent.is_dir():
        return final, found, f"{prefix}{parent} is not a directory"
    return final, found, None


def _temporary(final: Path) -> tuple[int, str]:
    """A new file beside ``final``, named after it within NAME_MAX (255 bytes): a 255-byte name is a valid output."""
    stem = os.fsencode(final.name)[:200].decode(errors="ignore") if final.name else "output"
    return tempfile.mkstemp(dir=final.parent, prefix=f".{stem}.", suffix=".tmp")


def output_problem(path: str | os.PathLike[str]) -> str | None:
    """None when :func:`write_bytes` can write ``path``; else why not, for a message after the path.

    Checked before any work, so a command whose output is unusable computes nothing: the kind of what is
    at the path (and at the end of its symlinks), and a real file created and removed in its directory
    (permission bits do not tell a read-only mount, /proc or root's view of a 0555 directory)."""
    final, _, why = _resolve(Path(path))
    if why is not None:
        return why
    try:
        fd, probe = _temporary(final)
    except OSError as exc:
        return f"directory {final.parent} is not writable ({exc.strerror or exc})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


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


def _seal(fd: int, name: str, mode: int) -> None:
    """Give the temporary file its mode and put it on disk; ``name`` may now be another file than ``fd`` (a library
    that writes by name may have replaced the empty file rather than rewritten it)."""
    if os.path.samestat(os.fstat(fd), os.stat(name)):
        os.fchmod(fd, mode)
        os.fsync(fd)
        return
    replaced = os.open(name, os.O_RDONLY)
    try:
        os.fchmod(replaced, mode)
        os.fsync(replaced)
    finally:
        os.close(replaced)


def _install(path: str | os.PathLike[str], fill: Callable[[int, str], None]) -> None:
    """Check the target, let ``fill`` write the temporary file (its open descriptor and its name), rename it."""
    path = Path(path)
    final, found, why = _resolve(path)
    if why is not None:
        raise OutputPathError(f"cannot write {path}: {why}")
    mode = found.st_mode & 0o7777 if found is not None else 0o666 & ~_umask()  # mkstemp's own mode is 0600
    try:
        fd, temporary = _temporary(final)
    except OSError as exc:  # named after the user's path, not the temporary one
        raise OSError(
            exc.errno, f"cannot create a file in directory {final.parent} ({exc.strerror})", str(path)
        ) from None
    try:
        try:
            fill(fd, temporary)
            _seal(fd, temporary, mode)
        finally:
            os.close(fd)
        try:
            now = os.lstat(final)
        except FileNotFoundError:
            now = None
        if now is not None and not stat.S_ISREG(now.st_mode):  # it changed kind since the check: keep it
            raise OutputPathError(f"cannot write {path}: {final} became {_kind(now.st_mode)} while it was being "
                                  f"written; nothing was replaced; {NOT_REPLACED}")  # fmt: skip
        os.replace(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the directory is synced
        directory = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the regular file at ``path`` (or create it) with ``data`` atomically, through symlinks.

    Raises :class:`OutputPathError` when what is there is not a regular file (nothing touched), OSError (the old
    file intact) when the write itself fails."""
    _install(path, lambda fd, _name: _write_all(fd, data))


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_with(path: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """As :func:`write_bytes`, for a library that writes a file by name: ``write(temporary_path)`` fills an empty
    temporary file beside the target, which then replaces it whole."""
    _install(path, lambda _fd, name: write(Path(name)))
