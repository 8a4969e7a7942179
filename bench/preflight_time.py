"""Wall time of `verl-npu preflight` on the GLM-5.2 example, each run a fresh process (imports included).

Cold runs start with an empty cache (verl's validation and the model config run in the worker, which
imports torch, transformers and verl); warm runs re-check the same launch (the cached answer is
reused, no torch import). Target: under 5 s on the dev machine. Prints a table and writes JSON with
the machine and versions.
Run: ``.venv/bin/python bench/preflight_time.py --out bench/results/preflight_time.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "examples" / "glm5_2" / "run_glm5_2_grpo_a3.sh"
TARGET_S = 5.0


def one_run(cache: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "preflight", str(LAUNCH), "--json", os.devnull],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "VERL_NPU_CACHE_DIR": str(cache)},
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(
            f"preflight did not say go (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="preflight_time.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        one_run(Path(scratch) / "warmup")  # warm the OS file cache, as on any machine that has run Python before
        cold = [one_run(Path(scratch) / f"cold{i}") for i in range(args.runs)]
        warm = [one_run(Path(scratch) / "cold0") for _ in range(args.runs)]
    result = {
        "what": f"verl-npu preflight {LAUNCH.relative_to(REPO)} (fresh process per run)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {p: importlib.metadata.version(p) for p in ("verl", "megatron-core", "torch", "transformers")},
        "date": datetime.date.today().isoformat(),
        "target_s": TARGET_S,
    }
    table = Table(title="verl-npu preflight, GLM-5.2 example")
    for column in ("cache", "runs", "median (s)", "max (s)", "target (s)", "meets target"):
        table.add_column(column, justify="right")
    for name, times in (("cold", cold), ("warm", warm)):
        row = {"runs_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3),
               "max_s": round(max(times), 3), "meets_target": max(times) < TARGET_S}  # fmt: skip
        result[name] = row
        table.add_row(name, str(len(times)), f"{row['median_s']:.2f}", f"{row['max_s']:.2f}", f"{TARGET_S:.1f}",
                      str(row["meets_target"]))  # fmt: skip
    Console().print(table)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["cold"]["meets_target"] and result["warm"]["meets_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
