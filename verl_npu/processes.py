"""Child processes with a time limit that ends the whole process group, not only the direct child.

``subprocess.run(..., timeout=)`` kills the direct child and waits for it: a grandchild (a shell
script's ``sleep``, a tool's helper daemon) lives on, and a child stuck in a driver call (``npu-smi``
in uninterruptible sleep) makes that wait last forever. Every verl-npu call site with a time limit
goes through :func:`run` (or :func:`start` and :func:`communicate` for a child started early):

- the child starts in its own session (``start_new_session=True``), so its process group is its own;
- on a timeout, or when the caller is interrupted, the group gets SIGTERM, then SIGKILL after
  :data:`GRACE_S`; the pipes are drained for at most :data:`REAP_S` more, and a group that still will
  not go is left behind rather than waited for;
- output is decoded with ``errors="replace"``: a tool printing bytes that are not UTF-8 is a finding,
  never a traceback;
- the :class:`Result` says whether it timed out, the exit code, and the first line of stderr.

Standard library only: install.sh's target detection (``python -m verl_npu.stack detect-target``)
runs it with a bare Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence

GRACE_S = 2.0  # between SIGTERM and SIGKILL to the group
REAP_S = 5.0  # after SIGKILL: how long the pipes may take to close before the group is left behind


@dataclasses.dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int | None  # None: it did not finish within the timeout (its group was killed)
    stdout: str | bytes
    stderr: str | bytes
    timed_out: bool = False
    timeout_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.returncode == 0

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def stderr_line(self, limit: int = 200) -> str:
        """The first non-blank line of stderr, printable and at most ``limit`` characters ('' when none)."""
        text = decode(self.stderr)
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        line = "".join(c if c.isprintable() else "?" for c in line)
        return line if len(line) <= limit else line[: limit - 3] + "..."

    def describe(self) -> str:
        """What went wrong, in one line: '`npu-smi info` exited 255: dcmi model initialized failed'."""
        first = self.stderr_line()
        if self.timed_out:
            what = f"`{self.command}` did not finish within {self.timeout_s:g} s (its process group was killed)"
        elif self.returncode is not None and self.returncode < 0:
            what = f"`{self.command}` was killed by signal {-self.returncode}"
        else:
            what = f"`{self.command}` exited {self.returncode}"
        return f"{what}: {first}" if first else f"{what} (no stderr)"


def decode(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")


def start(
    argv: Sequence[str],
    *,
    stdin: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, stdout and stderr piped (stdin piped when ``stdin``, else /dev/null).

    Raises what ``subprocess.Popen`` raises when it cannot start (FileNotFoundError, PermissionError, OSError).
    """
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
    )


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # The group id is the child's pid (start_new_session). The group outlives its leader while any member lives.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def end_group(proc: subprocess.Popen, grace: float = GRACE_S) -> tuple[bytes, bytes]:
    """SIGTERM to the child's process group, SIGKILL after ``grace`` s; what it wrote meanwhile.

    A group that has not closed its pipes :data:`REAP_S` s after SIGKILL (a process in uninterruptible
    sleep inside a driver) is left behind: the caller gets on instead of hanging with it.
    """
    out: bytes | None = b""
    err: bytes | None = b""
    _signal_group(proc, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
    except ValueError:  # the pipes were already closed by an earlier communicate()
        pass
    # the direct child is gone or unkillable; the rest of its group may not be (a grandchild that closed its
    # pipes): one more SIGKILL to the group, which costs nothing when it is empty
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    return out or b"", err or b""


def communicate(
    proc: subprocess.Popen[bytes],
    input: bytes | None = None,
    *,
    timeout: float | None,
    text: bool = True,
) -> Result:
    """Wait for a child from :func:`start` (sending ``input``); on a timeout or an interrupt, end its group."""
    argv = tuple(str(a) for a in (proc.args if isinstance(proc.args, list | tuple) else [proc.args]))
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = end_group(proc)
        return _result(argv, None, out, err, text, timed_out=True, timeout_s=timeout)
    except BaseException:  # KeyboardInterrupt, SystemExit from a SIGTERM handler: leave no group behind
        end_group(proc, grace=0.5)
        raise
    return _result(argv, proc.returncode, out, err, text, timeout_s=timeout)


def _result(argv, returncode, out, err, text: bool, *, timed_out: bool = False, timeout_s=None) -> Result:
    if text:
        out, err = decode(out), decode(err)
    return Result(argv, returncode, out, err, timed_out=timed_out, timeout_s=timeout_s)


def run(
    argv: Sequence[str],
    *,
    timeout: float | None,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    text: bool = True,
) -> Result:
    """Run ``argv`` to completion or ``timeout``; see the module docstring. Raises OSError when it cannot start."""
    proc = start(argv, stdin=input is not None, env=env, cwd=cwd)
    # not `with proc:`: its exit waits for the child without a limit, which a child stuck in a driver never ends
    return communicate(proc, input, timeout=timeout, text=text)
