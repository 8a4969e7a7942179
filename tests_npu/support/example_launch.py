"""The GLM-5.2 example launch, run with `python` standing in as verl's config composer (support/compose_verl_config.py):
the resolved config verl 0.9.1 would train with, from the real script, env file and Hydra schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.paths import REPO, SUPPORT

LAUNCH = REPO / "examples" / "glm5_2" / "run_glm5_2_grpo_a3.sh"
COMPOSE = SUPPORT / "compose_verl_config.py"


def launch(tmp_path: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the example with ``extra`` as its "$@" and ``env`` added; what the composer printed."""
    shim = tmp_path / "python"
    shim.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "{COMPOSE}" "$@"\n')
    shim.chmod(0o755)
    return subprocess.run(
        ["bash", str(LAUNCH), *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(shim), **env},
        timeout=300,
        check=False,
    )


def compose_example(tmp_path: Path, *extra: str) -> dict:
    """The example's resolved config (raises with the composer's message when it is refused)."""
    done = launch(tmp_path, *extra)
    if done.returncode != 0:
        raise RuntimeError(f"the GLM-5.2 example did not compose: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["config"]
