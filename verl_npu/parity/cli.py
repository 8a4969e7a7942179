"""`verl-npu parity`: the platform-parity job and its comparison with the CUDA reference.

    verl-npu parity run --dtype bf16 --out run.json [--model glm5_2 --model dense] [--path portable] [--steps 1]
                        [--replay-from FILE]
    verl-npu parity compare run.json [--reference ci/baselines/parity/reference.json] [--against other.json]
                                     [--exact] [--precise fp32-run.json] [--json report.json] [--plot layers.png]
    verl-npu parity independent fp64-run.json
    verl-npu parity reference --bf16 a.json --fp32 b.json --fp64 c.json --bf16-repeat d.json
                              --fp32-repeat e.json --out ci/baselines/parity/reference.json

Exit codes: 0 the comparison passes (or the run / reference was written); 1 it fails; 2 a bad input (the message
names it), in which case nothing is written (docs/errors.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_npu.parity.models import MODELS, REPO_ROOT

DEFAULT_REFERENCE = REPO_ROOT / "ci" / "baselines" / "parity" / "reference.json"


def _output(option: str, value: str | None, formats: tuple[str, ...] = ()) -> Path | None:
    """An output file, checked before any work: a regular file or a new one in a writable directory (a directory,
    device or FIFO is never replaced: verl_npu.atomic), and (``formats``) its suffix names one of them."""
    if value is None:
        return None
    from verl_npu.atomic import output_problem
    from verl_npu.inputs import InputError

    why = output_problem(value)
    if why is not None:
        raise InputError(option, value, f"a regular file, or a new one, in a writable directory ({value}: {why})")
    if formats and Path(value).suffix.lower().lstrip(".") not in formats:
        raise InputError(option, value, f"a file name ending in one of .{', .'.join(formats)}")
    return Path(value)


def cmd_run(args: argparse.Namespace) -> int:
    from verl_npu import inputs
    from verl_npu.parity import job
    from verl_npu.parity.run_format import MAX_STEPS

    # the option's text, read by verl_npu.inputs (ASCII digits): argparse's type=int also reads other scripts'
    # digits (Arabic-Indic, full-width) and '1_6'
    steps = inputs.integer("--steps", args.steps, minimum=1, maximum=MAX_STEPS)
    options = job.RunOptions(models=tuple(args.model or job.DEFAULT_MODELS), dtype=args.dtype, steps=steps,
                             path=args.path, replay_from=args.replay_from)  # fmt: skip
    out = _output("--out", args.out)
    result = job.run(options)
    job.write(result, out)
    models = ", ".join(result["models"])
    print(f"verl-npu parity run: {models} in {args.dtype} on {result['device']} -> {out}", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from verl_npu import atomic
    from verl_npu.checks import table
    from verl_npu.parity import compare as cmp
    from verl_npu.parity.run_format import RUN_KIND

    json_path, plot_path = _output("--json", args.json), _output("--plot", args.plot, cmp.PLOT_FORMATS)
    run = cmp.load(args.run, RUN_KIND)
    ref = cmp.load(args.reference, cmp.REFERENCE_KIND)
    mode = "exact" if args.exact else "pair" if args.against else "reference"
    if args.exact and not args.against:
        from verl_npu.inputs import InputError

        raise InputError("--exact", True, "--against OTHER_RUN as well (exact compares two runs of one build)")
    against = cmp.load(args.against, RUN_KIND) if args.against else cmp.reference_run(ref, cmp.run_dtype(run))
    precise = cmp.load(args.precise, RUN_KIND) if args.precise else None
    result = cmp.compare(run, against, ref, mode, models=args.model, precise=precise)
    from rich.console import Console

    Console(width=max(Console().width, 140)).print(
        table(result.checks, cmp.as_table_title(run, against, mode), escape=True)
    )
    if plot_path is not None:  # first: the JSON (which says ok or fail) is never left without its plot
        cmp.plot(result, plot_path, cmp.as_table_title(run, against, mode))
    if json_path is not None:
        report = {"run": args.run, "against": against.get("_path"), "mode": mode, **result.to_dict()}
        atomic.write_text(json_path, json.dumps(report, indent=2, allow_nan=False, default=str) + "\n")
    faults = {m: p for m, p in result.first_fault.items() if p}
    verdict = "FAIL" if result.failed else "OK"
    where = "; ".join(f"{m}: first fault at {p}" for m, p in faults.items())
    print(f"verl-npu parity compare: {verdict}" + (f" ({where})" if where else ""), file=sys.stderr)
    return 1 if result.failed else 0


def cmd_reference(args: argparse.Namespace) -> int:
    from verl_npu import atomic
    from verl_npu.parity import compare as cmp
    from verl_npu.parity.run_format import RUN_KIND

    out = _output("--out", args.out)
    runs = {d: cmp.load(getattr(args, d), RUN_KIND) for d in ("bf16", "fp32", "fp64")}
    repeats = {d: cmp.load(getattr(args, f"{d}_repeat"), RUN_KIND) for d in ("bf16", "fp32")}
    data = cmp.reference(runs, repeats)
    atomic.write_text(out, json.dumps(data, indent=1, allow_nan=False) + "\n")
    print(f"verl-npu parity reference: {out} from {data['device']}", file=sys.stderr)
    return 0


def cmd_independent(args: argparse.Namespace) -> int:
    import tempfile

    from verl_npu.parity import compare as cmp
    from verl_npu.parity import independent
    from verl_npu.parity.run_format import RUN_KIND

    run = cmp.load(args.run, RUN_KIND)
    with tempfile.TemporaryDirectory(prefix="verl-npu-independent-") as workdir:
        verdict = independent.check_run(run, workdir)
    for model, found in verdict.items():
        print(f"{model}: " + ("agrees with transformers in float64" if not found else "; ".join(found)))
    failed = any(verdict.values())
    print(f"verl-npu parity independent: {'FAIL' if failed else 'OK'}", file=sys.stderr)
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    from verl_npu.parity.job import DEFAULT_STEPS, PATHS
    from verl_npu.parity.run_format import DTYPES, MAX_STEPS

    parity = sub.add_parser("parity", help="the platform-parity job and its comparison with the CUDA reference")
    parity_sub = parity.add_subparsers(dest="parity_command", required=True)
    p = parity_sub.add_parser("run", help="run the deterministic parity job on this machine; write its JSON")
    p.add_argument("--model", action="append", help=f"a parity model (repeatable): {', '.join(MODELS)}")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--path", choices=PATHS, default="default", help="the operators (default: the platform's)")
    p.add_argument("--steps", default=DEFAULT_STEPS, help=f"training steps (1 to {MAX_STEPS})")
    p.add_argument("--replay-from", metavar="FILE", help="a parity run, or the reference (its run of --dtype), whose "
                   "block inputs each block is fed again (the judgement of `parity compare`)")  # fmt: skip
    p.add_argument("--out", required=True, metavar="FILE")
    p.set_defaults(func=cmd_run)
    p = parity_sub.add_parser("compare", help="a run against the reference (or another run); exit 1 on a mismatch")
    p.add_argument("run", help="a `parity run` JSON")
    p.add_argument("--reference", default=str(DEFAULT_REFERENCE), help="the CUDA reference (its tolerances)")
    p.add_argument("--against", metavar="RUN", help="compare with this run instead of the reference's")
    p.add_argument("--exact", action="store_true", help="with --against: any difference fails (one build, one node)")
    p.add_argument("--model", action="append", help="judge only this model (repeatable; default: every model)")
    p.add_argument("--precise", metavar="RUN", help="a bf16 run's fp32 run on the same node, which it was replayed "
                   "from (--replay-from): judged against it with the reference's measured bf16 error")  # fmt: skip
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE", help="per-layer differences (png, svg, pdf)")
    p.set_defaults(func=cmd_compare)
    p = parity_sub.add_parser("independent", help="an fp64 run against transformers' own models in float64 "
                              "(docs/parity.md); exit 1 on a disagreement")  # fmt: skip
    p.add_argument("run", help="a `parity run --dtype fp64` JSON")
    p.set_defaults(func=cmd_independent)
    p = parity_sub.add_parser("reference", help="derive the tolerances from reference-device runs; write the file")
    for dtype in ("bf16", "fp32", "fp64"):
        p.add_argument(f"--{dtype}", required=True, metavar="RUN")
    for dtype in ("bf16", "fp32"):
        p.add_argument(f"--{dtype}-repeat", required=True, metavar="RUN", help=f"a second {dtype} run")
    p.add_argument("--out", required=True, metavar="FILE")
    p.set_defaults(func=cmd_reference)
