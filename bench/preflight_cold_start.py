"""Preflight's cold start as a ratio: a first `verl-npu preflight` of the GLM-5.2 example against `import verl`.

Both run as fresh processes, alternately (so the machine's load hits both alike): ``python -c "import verl"``, then
``verl-npu preflight examples/glm5_2/run_glm5_2_grpo_a3.sh`` with an empty cache directory (the worker imports
torch, transformers and verl). A cold preflight cannot beat the import it waits on, so the ratio says what
preflight adds on top: target <= 1.2. Then the warm re-check (same launch, cached answer, no torch): target
<= 1.5 s. Prints a rich table and writes JSON (device, python and verl versions, each run, the medians, the ratio).

Run: ``.venv/bin/python bench/preflight_cold_start.py`` (writes bench/results/preflight_cold_start.json).
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
OUT = REPO / "bench" / "results" / "preflight_cold_start.json"
TARGET_RATIO, TARGET_WARM_S = 1.2, 1.5
IMPORT_VERL = [sys.executable, "-c", "import verl"]


def preflight(scratch: Path) -> list[str]:
    """The check, writing its JSON report into ``scratch`` (preflight refuses to write a device such as /dev/null)."""
    return [sys.executable, "-m", "verl_npu.cli", "preflight", str(LAUNCH), "--json", str(scratch / "report.json")]


def timed(command: list[str], cache: Path | None = None) -> float:
    """Wall seconds of one fresh process; a failure stops the benchmark."""
    env = {**os.environ, "VERL_NPU_CACHE_DIR": str(cache)} if cache is not None else None
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=REPO)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def summary(times: list[float]) -> dict:
    return {"runs_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="cold pairs and warm re-checks")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    load_before = load()
    with tempfile.TemporaryDirectory() as scratch:
        timed(IMPORT_VERL)  # the OS file cache warm, as on any machine that has imported verl before
        imports, colds = [], []
        for i in range(args.runs):
            imports.append(timed(IMPORT_VERL))
            colds.append(timed(preflight(Path(scratch)), Path(scratch) / f"cold{i}"))  # an empty cache each time
        warms = [timed(preflight(Path(scratch)), Path(scratch) / "cold0") for _ in range(args.runs)]
    ratio = statistics.median(colds) / statistics.median(imports)
    paired = statistics.median(c / i for c, i in zip(colds, imports, strict=True))
    result = {
        "what": f"verl-npu preflight {LAUNCH.relative_to(REPO)} (empty cache) over `python -c 'import verl'`, "
        "fresh processes, alternating; then warm re-checks (cached answer)",
        "device": {
            "kind": "cpu",
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": load(),
        },
        "python": platform.python_version(),
        "versions": {p: importlib.metadata.version(p) for p in ("verl", "verl-npu", "torch", "transformers")},
        "date": datetime.date.today().isoformat(),
        "verl_npu_commit": commit(),
        "import_verl": summary(imports),
        "preflight_cold": summary(colds),
        "preflight_warm": summary(warms),
        "ratio": round(ratio, 3),
        "ratio_median_of_pairs": round(paired, 3),
        "target_ratio": TARGET_RATIO,
        "target_warm_s": TARGET_WARM_S,
        "meets_ratio": ratio <= TARGET_RATIO,
        "meets_warm": statistics.median(warms) <= TARGET_WARM_S,
    }
    table = Table(title=f"preflight cold start on {cpu_model()} ({os.cpu_count()} CPUs)")
    for column in ("what", "runs", "median (s)", "target", "meets"):
        table.add_column(column, justify="right")
    table.add_row("python -c 'import verl'", str(args.runs), f"{result['import_verl']['median_s']:.2f}", "", "")
    table.add_row("preflight, empty cache", str(args.runs), f"{result['preflight_cold']['median_s']:.2f}", "", "")
    table.add_row("ratio cold / import verl", "", f"{ratio:.3f} (pairs {paired:.3f})", f"<= {TARGET_RATIO}",
                  str(result["meets_ratio"]))  # fmt: skip
    table.add_row("preflight, warm re-check", str(args.runs), f"{result['preflight_warm']['median_s']:.2f}",
                  f"<= {TARGET_WARM_S} s", str(result["meets_warm"]))  # fmt: skip
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["meets_ratio"] and result["meets_warm"] else 1


if __name__ == "__main__":
    sys.exit(main())
