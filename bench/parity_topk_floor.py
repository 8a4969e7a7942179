"""The top-k floor over random selection (issue 30, item 5), measured: for the model at the fused DSA operators'
shapes (``glm5_2_fused_shape``: 2048-token sequences, top-k 1024), a clean bf16 run's selection against its own fp32
run over every query row, what a random selection scores on those rows, and the floor a comparison applies.

Per DSA layer and micro-batch: the overlap over every query row (within the record's key sample) and over the exact
rows a record also stores; what a random selection of k keys scores there (``random``); the floor from the
reference's measured bf16 error alone (1 - 2 x its measured disagreement) and the floor in force (raised to
TOPK_MARGIN of the way from random to 1, verl_npu/parity/compare.py); how far the clean run sits above it; and a
selection drawn at random against the same fp32 run, which must fall below it. Then the clean bf16 run judged as the
nightly judges it (``parity compare BF16 --precise FP32``).

Run: ``python bench/parity_topk_floor.py --out bench/results/parity_topk_floor_<device>.json [--fp32 RUN --bf16
RUN]`` (without runs, it makes them: the fp32 run, then the bf16 run; each some minutes on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "glm5_2_fused_shape"


def _make(dtype: str, out: Path) -> Path:
    argv = [
        sys.executable,
        "-m",
        "verl_npu.cli",
        "parity",
        "run",
        "--model",
        MODEL,
        "--dtype",
        dtype,
        "--out",
        str(out),
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"parity run --dtype {dtype}: {done.stderr[-3000:]}")
    return out


def _random_like(record: dict, seed: int) -> dict:
    """A selection of the record's [b, s, k] drawn at random (causal), recorded as the job records one."""
    import torch

    from verl_npu.parity.probes import topk_record

    if "all_rows" in record:
        b, s = record["all_rows"]["shape"]
    else:  # every row stored exactly: the last row is the last sequence's last query
        b, s = (1 + max(r[axis] for r in record["rows"]) for axis in (0, 1))
    k = record["k"]
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, s, s, generator=gen).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    values, indices = scores.topk(k, dim=-1)
    return json.loads(json.dumps(topk_record(record["kind"], indices.masked_fill(values == float("-inf"), -1))))


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from verl_npu import atomic
    from verl_npu.parity import compare as cmp
    from verl_npu.parity.cli import DEFAULT_REFERENCE
    from verl_npu.parity.job import versions
    from verl_npu.parity.run_format import RUN_KIND

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--fp32", help=f"a clean fp32 run of {MODEL} (default: made here)")
    parser.add_argument("--bf16", help=f"a clean bf16 run of {MODEL} on the same machine (default: made here)")
    parser.add_argument("--reference", default=str(DEFAULT_REFERENCE))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="verl-npu-topk-floor-") as directory:
        fp32_path = Path(args.fp32) if args.fp32 else _make("fp32", Path(directory) / "fp32.json")
        bf16_path = Path(args.bf16) if args.bf16 else _make("bf16", Path(directory) / "bf16.json")
        fp32, bf16 = cmp.load(fp32_path, RUN_KIND), cmp.load(bf16_path, RUN_KIND)
    ref = cmp.load(args.reference, cmp.REFERENCE_KIND)
    measured = ref["errors"]["bf16"][MODEL]["topk_disagreement"]
    ours, theirs = cmp.model_values(bf16, MODEL).topk, cmp.model_values(fp32, MODEL).topk
    records = fp32["models"][MODEL]["eval"]["topk"]
    rows = []
    for n, layer in enumerate(sorted(theirs, key=cmp.depth)):
        every = cmp.agreement(ours[layer], theirs[layer])
        exact = cmp.overlap(ours[layer].rows, theirs[layer].rows)
        drawn = cmp.agreement(cmp._topk("drawn", {layer: _random_like(records[layer], n)})[layer], theirs[layer])
        measured_floor = max(0.0, 1.0 - cmp.TRIANGLE * measured[layer])
        floor = cmp.topk_floor(measured_floor, every.random)
        rows.append({
            "layer": layer, "kind": records[layer]["kind"], "k": theirs[layer].k, "rows": every.rows,
            "every_row": every.every_row, "key_sample_rate": records[layer].get("all_rows", {}).get("rate", 1),
            "overlap_every_row": every.overlap, "overlap_stored_rows": exact, "stored_rows": len(theirs[layer].rows),
            "random": every.random, "measured_floor": measured_floor, "floor": floor,
            "floor_above_random": floor - every.random, "clean_above_floor": every.overlap - floor,
            "random_selection_overlap": drawn.overlap, "random_selection_fails": drawn.overlap < floor,
        })  # fmt: skip
    judged = cmp.compare(bf16, cmp.reference_run(ref, "bf16"), ref, models=[MODEL], precise=fp32)
    table = Table(title=f"{MODEL}: bf16 against its own fp32 run, top-k over every query row ({bf16.get('device')})")
    for column in ("layer", "kind", "rows", "clean", "16 rows", "random", "measured floor", "floor", "clean - floor",
                   "drawn at random"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["layer"], r["kind"], str(r["rows"]), f"{r['overlap_every_row']:.3f}", f"{r['overlap_stored_rows']:.3f}",
            f"{r['random']:.3f}", f"{r['measured_floor']:.3f}", f"{r['floor']:.3f}", f"{r['clean_above_floor']:+.3f}",
            f"{r['random_selection_overlap']:.3f} ({'fails' if r['random_selection_fails'] else 'PASSES'})",
        )  # fmt: skip
    console = Console(width=200)
    console.print(table)
    failed = [(c.check, c.detail) for c in judged.checks if c.status == "fail"]
    console.print(f"parity compare --precise: {'FAIL' if judged.failed else 'ok'} {failed[:6]}")
    report = {
        "what": f"{MODEL}'s top-k over every query row against the floor over random selection "
        "(bench/parity_topk_floor.py)",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": bf16.get("device"),
        "versions": versions(),
        "margin": cmp.TOPK_MARGIN,
        "reference": str(Path(args.reference).resolve().relative_to(REPO)),
        "layers": rows,
        "compare_precise": {"verdict": "fail" if judged.failed else "ok", "failed": failed},
    }
    atomic.write_text(args.out, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
