"""Writing outputs: all or nothing, and only over a regular file."""

from __future__ import annotations

import contextlib
from pathlib import Path

from verl_npu import atomic


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (its missing directories made first) through verl_npu.atomic: a reader or a
    failed run never sees half a file, an existing file stays until the new one is whole, and a directory, device
    or FIFO at ``path`` is refused (atomic.OutputPathError), never replaced."""
    path = Path(path)
    with contextlib.suppress(OSError):  # a directory that cannot be made: the write names what is in the way
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, text)
