"""verl_npu.processes: a timeout ends the child's whole process group, and every call site with a timeout uses it."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest
from support.paths import REPO
from support.processes import alive, gone_soon, grandchild, hanging_script

from verl_npu import processes


@pytest.mark.parametrize("ignore_term", [False, True], ids=["dies-on-term", "ignores-term"])
def test_a_timeout_ends_the_grandchild_too(tmp_path, ignore_term):
    script = hanging_script(tmp_path / "tool", tmp_path / "pid", ignore_term=ignore_term, stdout=b"partial\n")
    started = time.monotonic()
    result = processes.run([str(script)], timeout=1.0)
    took = time.monotonic() - started
    pid = grandchild(tmp_path / "pid")
    assert result.timed_out and result.returncode is None and not result.ok
    assert result.stdout == "partial\n"  # what it printed before the limit is kept
    assert "did not finish within 1 s (its process group was killed)" in result.describe()
    assert gone_soon(pid), f"grandchild {pid} outlived the timeout"
    assert took < 1.0 + processes.GRACE_S + 2.0, took


def test_exit_code_first_stderr_line_and_undecodable_output():
    code = "import sys; sys.stdout.buffer.write(b'\\xff\\xfeok'); sys.stderr.write('\\n  dcmi model initialized failed\\nmore\\n'); sys.exit(255)"  # noqa: E501
    result = processes.run([sys.executable, "-c", code], timeout=60)
    assert not result.timed_out and result.returncode == 255 and not result.ok
    assert result.stdout == "\ufffd\ufffdok"
    assert result.stderr_line() == "dcmi model initialized failed"
    assert result.describe().endswith("exited 255: dcmi model initialized failed")


def test_bytes_in_and_out():
    result = processes.run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])"],
                           input=b"\x00\x01\xff", timeout=60, text=False)  # fmt: skip
    assert result.ok and result.stdout == b"\xff\x01\x00"


def test_an_interrupted_wait_ends_the_group(tmp_path):
    """Ctrl-C (or a SIGTERM turned into SystemExit) while waiting: the child's session would not get the signal."""
    script = hanging_script(tmp_path / "tool", tmp_path / "pid")
    proc = processes.start([str(script)])
    pid = grandchild(tmp_path / "pid")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            processes.communicate(proc, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert gone_soon(pid) and not alive(proc.pid)


def test_a_missing_command_raises_oserror():
    with pytest.raises(FileNotFoundError):
        processes.run(["/nonexistent/verl-npu-tool"], timeout=5)


CALL = re.compile(r"subprocess\.(run|Popen|call|check_call|check_output)\(")


def test_no_subprocess_call_in_verl_npu_bypasses_the_helper():
    """A time limit that kills only the direct child leaves grandchildren; verl_npu starts children through
    verl_npu.processes."""
    offenders = []
    for source in sorted((REPO / "verl_npu").rglob("*.py")):
        if source.name == "processes.py" and source.parent.name == "verl_npu":
            continue
        for number, line in enumerate(source.read_text().splitlines(), start=1):
            if CALL.search(line):
                offenders.append(f"{source.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)
