"""The parity job on the CPU, run once per (dtype, injection, models) for the whole test session.

Each run is its own process (the job sets deterministic mode and the process group for its whole process), through
tests_npu/support/parity_injections.py, the entry point of ``verl-npu parity run`` with an optional fault injected.
Several test modules judge the same runs (the clean fp32/fp64/bf16 runs, each fault's run): one process per run
keeps the suite's time to what the judgements need.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.paths import SUPPORT

INJECT = SUPPORT / "parity_injections.py"
CPU_MODELS = ("glm5_2", "dense")


def run_job(out: Path, dtype: str, inject: str = "none", models=CPU_MODELS, extra: tuple[str, ...] = ()) -> dict:
    """One parity run on the CPU, written to ``out`` and loaded (checked) as ``parity compare`` loads it."""
    from verl_npu.parity import compare as cmp
    from verl_npu.parity.run_format import RUN_KIND

    argv = [sys.executable, str(INJECT), "--inject", inject, "--dtype", dtype, "--out", str(out), *extra]
    for model in models:
        argv += ["--model", model]
    env = {**os.environ, "VERL_NPU_PLATFORM": "cpu", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return cmp.load(out, RUN_KIND)


class ParityRuns:
    """Runs made at most once per session, each kept as a file in ``directory`` (the CLI tests read the files)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._runs: dict[tuple[Any, ...], dict] = {}

    def path(self, dtype: str, inject: str = "none", models=CPU_MODELS, extra: tuple[str, ...] = ()) -> Path:
        # an argument may be a path (--replay-from): its slashes would make the name a path into folders that are not
        suffix = "-".join([inject, dtype, *models, *(e.lstrip("-").replace("/", "_") for e in extra)])
        return self.directory / f"{suffix}.json"

    def get(self, dtype: str, inject: str = "none", models=CPU_MODELS, extra: tuple[str, ...] = ()) -> dict:
        key = (dtype, inject, tuple(models), tuple(extra))
        if key not in self._runs:
            self._runs[key] = run_job(self.path(dtype, inject, models, extra), dtype, inject, models, extra)
        return self._runs[key]
