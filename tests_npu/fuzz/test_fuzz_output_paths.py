"""Hostile output paths (issue 29, class 1): whatever is at the path a writer is given, it is never destroyed.

Property, for every writer of the CLI's files (verl_npu.atomic and each module's own entry to it) and any output
path: a chain of zero to three symlinks (absolute or relative, each in its own directory) ending at nothing, a
regular file, a directory, a FIFO, a socket or a device node, under any file name a file system takes:
- it ends at a regular file, or at nothing in an existing directory: the write succeeds, that file holds the new
  content, and every link of the chain is still the same link;
- it ends at anything else, or in a directory that does not exist: OutputPathError naming the path, and every
  object on the way (links, the directory, FIFO, socket or device) is as it was;
- either way no temporary file is left behind, and a file beside the target is untouched.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from verl_npu import atomic

NEW = {"written": "by the fuzz"}


def _preflight_json(path: Path) -> None:
    from verl_npu.checks import OK, Check
    from verl_npu.preflight.report import PreflightReport, write_json

    write_json(PreflightReport("<overrides>", "a3", [Check("x.y", OK, "fine")], [], model=NEW), path)


def _doctor_report(path: Path) -> None:
    from verl_npu.doctor import report

    report.write(json.dumps(NEW), path)


def _k8s_output(path: Path) -> None:
    from verl_npu.k8s.files import write_atomically

    write_atomically(path, json.dumps(NEW))


def _parity_run(path: Path) -> None:
    from verl_npu.parity import job

    job.write(NEW, path)


WRITERS = {
    "atomic.write_bytes": lambda path: atomic.write_bytes(path, json.dumps(NEW).encode()),
    "atomic.write_text": lambda path: atomic.write_text(path, json.dumps(NEW)),
    "atomic.write_with": lambda path: atomic.write_with(path, lambda temporary: temporary.write_text(json.dumps(NEW))),
    "preflight write_json": _preflight_json,
    "doctor report.write": _doctor_report,
    "k8s write_atomically": _k8s_output,
    "parity job.write": _parity_run,
}
# `k8s render -o` makes the output's missing directories first (the path's own, not a link target's)
MAKES_DIRECTORIES = {"k8s write_atomically"}
KINDS = ("nothing", "regular file", "directory", "FIFO", "socket", "device")
# any name one directory entry may have: no "/" or NUL, at most NAME_MAX (255) bytes, not "." or ".."
NAMES = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=80)
NAMES = NAMES.filter(lambda n: len(n.encode()) <= 255 and n not in (".", ".."))


def _holds_new(path: Path) -> bool:
    data = json.loads(path.read_text())
    return data == NEW or data.get("model") == NEW  # preflight's report holds it as its model


def _make(kind: str, path: Path) -> str:
    """Make ``kind`` at ``path``; returns what the refusal calls it ('' for what is written)."""
    if kind == "regular file":
        path.write_text("old")
        return ""
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_text("old")
        return "directory"
    if kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()  # the socket file stays
        return "socket"
    if kind == "device":
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            return "character device"
        except PermissionError:  # no CAP_MKNOD: a FIFO is refused the same way
            pass
    if kind in ("device", "FIFO"):
        os.mkfifo(path)
        return "FIFO"
    return ""


def _state(root: Path) -> dict[str, tuple]:
    """Every object under ``root``, not followed: kind, inode, a link's text, a regular file's bytes."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
            data = Path(path).read_bytes() if stat.S_ISREG(info.st_mode) else None
            found[os.path.relpath(path, root)] = (stat.S_IFMT(info.st_mode), info.st_ino, link, data)
    return found


@given(
    writer=st.sampled_from(sorted(WRITERS)),
    kind=st.sampled_from(KINDS),
    links=st.lists(st.booleans(), max_size=3),  # one per link of the chain: True = a relative link
    name=NAMES,
    parent_exists=st.booleans(),
)
def test_no_output_path_is_destroyed_and_links_are_written_through(writer, kind, links, name, parent_exists):
    with tempfile.TemporaryDirectory(prefix="out-") as scratch:
        root = Path(scratch)
        final_dir = root / "final"
        if parent_exists or kind != "nothing":
            final_dir.mkdir()
        # a socket's address must fit in 108 bytes: its name is short, whatever the fuzz drew
        final = final_dir / ("s" if kind == "socket" else name)
        refusal = _make(kind, final) if final_dir.exists() else ""
        (root / "bystander").write_text("old")
        path = final
        for depth, relative in enumerate(links):
            link_dir = root / f"link{depth}"
            link_dir.mkdir()
            link = link_dir / name
            link.symlink_to(os.path.relpath(path, link_dir) if relative else path)
            path = link
        made = not final_dir.exists() and not links and writer in MAKES_DIRECTORIES
        before = _state(root)
        try:
            WRITERS[writer](path)
        except atomic.OutputPathError as exc:
            assert refusal or not (final_dir.exists() or made), f"{writer} refused {kind} after {len(links)} links"
            assert str(path) in str(exc) and (f"is a {refusal}" if refusal else "does not exist") in str(exc)
            assert _state(root) == before, "a refused write changed what was there"
            return
        assert not refusal and (final_dir.exists() or made), f"{writer} wrote over a {refusal}"
        after = _state(root)
        changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
        expected = {os.path.relpath(final, root)} | ({"final"} if made else set())
        assert changed == expected, changed  # the links, the bystander: as they were
        assert stat.S_ISREG(os.lstat(final).st_mode) and _holds_new(final)
