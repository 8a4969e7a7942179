"""Commands that leave a grandchild behind, and a check that it is gone (tests of verl_npu.processes' callers)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed orphan stays a zombie where PID 1 does not reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc here: kill(pid, 0) succeeded, so it exists
        return True
    return state not in ("Z", "X")


def gone_soon(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def hanging_script(path: Path, pid_file: Path, *, ignore_term: bool = False, stdout: bytes = b"") -> Path:
    """An executable that prints ``stdout``, starts a grandchild sleeping for ever (its pid in ``pid_file``) and waits.

    ``ignore_term``: both ignore SIGTERM, so only the SIGKILL to the group ends them.
    """
    trap = "trap '' TERM\n" if ignore_term else ""
    printed = "".join(f"\\{b:03o}" for b in stdout)
    path.write_text(
        "#!/bin/bash\n"
        f"{trap}"
        f"printf '{printed}'\n"
        "sleep 100000 &\n"
        f'echo $! > "{pid_file}.tmp" && mv "{pid_file}.tmp" "{pid_file}"\n'
        "wait\n"
    )
    path.chmod(0o755)
    return path


def grandchild(pid_file: Path, within: float = 10.0) -> int:
    deadline = time.monotonic() + within
    while not pid_file.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{pid_file} was never written: the script did not start its grandchild")
        time.sleep(0.02)
    return int(pid_file.read_text())
