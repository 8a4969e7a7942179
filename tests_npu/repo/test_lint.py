"""Python sources are ruff-clean (the shell and Dockerfile linters live in their own tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import REPO


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    done = subprocess.run(
        [ruff, "check", "verl_npu", "tests_npu", "bench"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
