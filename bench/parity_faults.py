"""Parity fault detection (issue 30): every injected fault (tests_npu/support/parity_injections.py) run through the
nightly's judgements on this machine, as a table and a JSON.

Per fault, as ci/nightly/parity.sh runs a node:

- ``fp32-vs-cuda``: the fault's fp32 run, each block fed the CUDA reference's fp32 inputs (``--replay-from`` the
  reference), judged against the reference (``verl-npu parity compare RUN``);
- ``bf16-vs-own-fp32``: the fault's bf16 run, each block fed the same node's fp32 run's inputs (that run has the fault
  too), judged against it with the reference's measured bf16 error (``--precise``).

A fault fails the nightly when either fails. Each cell gives the verdict, the first block out of tolerance (the
module the comparison names) and its difference over its tolerance. The clean runs are judged too: they must pass.

Run: ``python bench/parity_faults.py --out bench/results/parity_faults_<device>.json [--jobs 4] [--fault NAME ...]``
(CPU: ``VERL_NPU_PLATFORM=cpu``). Each run is its own process (a fault patches the engine for its whole process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INJECT = REPO / "tests_npu" / "support" / "parity_injections.py"
MODES = ("fp32-vs-cuda", "bf16-vs-own-fp32")


def _run(inject: str, dtype: str, models: tuple[str, ...], replay_from: Path, out: Path) -> Path:
    argv = [
        sys.executable,
        str(INJECT),
        "--inject",
        inject,
        "--dtype",
        dtype,
        "--out",
        str(out),
        "--replay-from",
        str(replay_from),
    ]
    for model in models:
        argv += ["--model", model]
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=1800, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{inject} {dtype}: {done.stderr[-3000:]}")
    return out


def _fault(inject: str, models: tuple[str, ...], reference: Path, workdir: Path, clean_fp32: Path | None) -> dict:
    """Both judgements of one fault. A fault whose fp32 run refuses to run (megatron's Hadamard rotation takes bf16
    only) has the clean fp32 run as its node's fp32 run: that node's fp32 path never meets the fault."""
    from verl_npu.parity import compare as cmp
    from verl_npu.parity.run_format import RUN_KIND

    out: dict = {}
    try:
        fp32 = _run(inject, "fp32", models, reference, workdir / f"{inject}-fp32.json")
    except RuntimeError as exc:
        if clean_fp32 is None:
            raise
        out["fp32-vs-cuda"] = {"verdict": "refused", "why": str(exc).strip().splitlines()[-1][:300]}
        fp32 = clean_fp32
    ref = cmp.load(reference, cmp.REFERENCE_KIND)
    runs = {"fp32": cmp.load(fp32, RUN_KIND)}
    judged = {}
    if "fp32-vs-cuda" not in out:
        judged["fp32-vs-cuda"] = cmp.compare(runs["fp32"], cmp.reference_run(ref, "fp32"), ref, models=models)
    try:
        bf16 = _run(inject, "bf16", models, fp32, workdir / f"{inject}-bf16.json")
    except RuntimeError as exc:
        out["bf16-vs-own-fp32"] = {"verdict": "refused", "why": str(exc).strip().splitlines()[-1][:300]}
    else:
        judged["bf16-vs-own-fp32"] = cmp.compare(
            cmp.load(bf16, RUN_KIND), cmp.reference_run(ref, "bf16"), ref, models=models, precise=runs["fp32"]
        )
    for mode, result in judged.items():
        failed = [c for c in result.checks if c.status == "fail"]
        first = {m: p for m, p in result.first_fault.items() if p}
        ratio = max(
            (r for layers in result.layer_differences.values() for p, r in layers if p in first.values()), default=None
        )
        out[mode] = {
            "verdict": "fail" if result.failed else "ok",
            "first_fault": first,
            "first_ratio": ratio,  # the first failing block's |d| / tolerance
            "failed_checks": len(failed),
            "failed": [c.check for c in failed][:12],
        }
    return out


def _models_of(inject: str) -> tuple[str, ...]:
    return ("dense",) if inject in ("qkv_bias_dropped", "gqa_tiled") else ("glm5_2",)


def _injections() -> tuple[str, ...]:
    """The injection names, from the test support script (loaded from its file: it is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("parity_injections", INJECT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.INJECTIONS)


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from verl_npu import atomic
    from verl_npu.parity.cli import DEFAULT_REFERENCE
    from verl_npu.parity.job import versions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reference", default=str(DEFAULT_REFERENCE))
    parser.add_argument("--fault", action="append", help="only these (default: every injection and the clean run)")
    parser.add_argument("--jobs", type=int, default=1, help="faults judged at once (each is two processes in turn)")
    parser.add_argument("--device", default=None, help="the machine's name in the JSON (default: the parity job's)")
    args = parser.parse_args()
    faults = args.fault or list(_injections())
    reference = Path(args.reference).resolve()
    with tempfile.TemporaryDirectory(prefix="verl-npu-parity-faults-") as directory:
        workdir = Path(directory)
        clean = _fault("none", ("glm5_2", "dense"), reference, workdir, None)  # first: the others may need its run
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {
                f: pool.submit(_fault, f, _models_of(f), reference, workdir, workdir / "none-fp32.json")
                for f in faults
                if f != "none"
            }
            results = {"none": clean} | {f: futures[f].result() for f in futures}
        device = args.device or json.loads((workdir / "none-fp32.json").read_text())["device"]
    table = Table(title=f"parity fault detection on {device} (reference: {reference.name})")
    table.add_column("fault")
    for mode in MODES:
        table.add_column(mode)
    table.add_column("nightly")
    for fault, cells in results.items():
        shown = []
        for mode in MODES:
            cell = cells[mode]
            if cell["verdict"] == "refused":
                shown.append("the run stops (an error)")
                continue
            where = ", ".join(f"{m}: {p}" for m, p in cell["first_fault"].items()) or "-"
            ratio = f" ({cell['first_ratio']:.3g}x)" if cell["first_ratio"] is not None else ""
            shown.append(f"{cell['verdict'].upper()} {where}{ratio}")
        nightly = "FAIL" if any(cells[m]["verdict"] in ("fail", "refused") for m in MODES) else "ok"
        table.add_row(fault, *shown, nightly)
    Console(width=200).print(table)
    report = {
        "what": "each injected parity fault through the nightly's judgements (bench/parity_faults.py)",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device,
        "versions": versions(),
        "reference": str(reference.relative_to(REPO)) if reference.is_relative_to(REPO) else str(reference),
        "modes": list(MODES),
        "results": results,
    }
    atomic.write_text(args.out, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
