"""The hostile-input property suite (issue 18): hypothesis profiles and the CLI invariant.

Profiles: "ci" (default) keeps each property to a few dozen examples so the whole suite runs in
well under two minutes on a 2-core CI machine; HYPOTHESIS_PROFILE=deep runs many more on a dev box.
The examples a run finds are committed as regular tests next to the code they exercise.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest

try:
    from hypothesis import HealthCheck, settings
except ModuleNotFoundError as exc:  # collection stops here: say which install brings it
    raise ModuleNotFoundError(
        f"{exc}: tests_npu/fuzz needs verl-npu's test extra (pip install -e '.[test]'; the images and "
        "bash install.sh --dev install it)"
    ) from exc

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,  # a 2-core CI machine is slow and uneven; the hang invariant is a timeout, not this
    derandomize=True,  # the same examples on every run: CI is repeatable, and a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def run_cli():
    """Run `verl-npu ARGS` in this process; return (exit code, stdout, stderr).

    The invariant every property checks through it: an exit code of 0, 1 or 2, and no traceback.
    Exit 3 is the CLI's "internal error" (an exception no boundary turned into a named error).
    """
    from verl_npu.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's own usage errors
                code = exc.code if isinstance(exc.code, int) else 2
        stderr = err.getvalue()
        assert code in (0, 1, 2), f"verl-npu {' '.join(argv)} exited {code}:\n{stderr}"
        assert "Traceback" not in stderr + out.getvalue(), stderr
        return code, out.getvalue(), stderr

    return run
