"""Benchmark: added import time of `import verl` with the verl-npu layer vs without.

Runs `python -c "import verl"` in fresh processes, alternating the two variants (without, then
with VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor) so that disk-cache warmth and machine
load affect both alike; reports the median of N runs each and the overhead ratio (target < 10%).
Prints a table and writes JSON with the device and versions.

    python bench/import_time.py [--runs 10] [--device-name "NVIDIA H100 host"] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

LAYER = "verl_npu.megatron_adaptor"
CODE = "import time; t = time.perf_counter(); import verl; print(time.perf_counter() - t)"


def one_run(with_layer: bool, extra_env: dict[str, str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(extra_env)
    if with_layer:
        env["VERL_USE_EXTERNAL_MODULES"] = LAYER
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"`import verl` failed (with_layer={with_layer}):\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_description(name: str | None) -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    with contextlib.suppress(OSError):
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout.strip() or None
    return {"name": name or platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device-name", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment")
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)

    for _ in range(args.warmup):
        one_run(False, extra_env)
        one_run(True, extra_env)
    without, with_layer = [], []
    for _ in range(args.runs):
        without.append(one_run(False, extra_env))
        with_layer.append(one_run(True, extra_env))
    base, layered = statistics.median(without), statistics.median(with_layer)
    overhead = layered / base - 1.0

    result = {
        "benchmark": "import verl: with vs without VERL_USE_EXTERNAL_MODULES=verl_npu.megatron_adaptor",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_description(args.device_name),
        "versions": {
            "python": platform.python_version(),
            **{d: version(d) for d in ("verl", "verl-npu", "torch", "megatron-core", "ray", "transformers")},
        },
        "environment": {k: v for k, v in extra_env.items()},
        "runs": args.runs,
        "seconds_without_layer": without,
        "seconds_with_layer": with_layer,
        "median_without_s": base,
        "median_with_s": layered,
        "overhead_ratio": overhead,
        "target_overhead_ratio": 0.10,
        "meets_target": overhead < 0.10,
    }
    table = Table(title=f"import verl, median of {args.runs} fresh processes ({result['device']['name']})")
    for column in ("variant", "median s", "min s", "max s"):
        table.add_column(column)
    table.add_row("without layer", f"{base:.3f}", f"{min(without):.3f}", f"{max(without):.3f}")
    table.add_row("with layer", f"{layered:.3f}", f"{min(with_layer):.3f}", f"{max(with_layer):.3f}")
    table.add_row("overhead", f"{overhead:+.1%}", "", "target < 10%")
    Console().print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
