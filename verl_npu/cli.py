"""The ``verl-npu`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from verl_npu.errors import UserError
from verl_npu.stack.manifest import MANIFEST_PATH, TARGETS, Stack, load_stack

if TYPE_CHECKING:  # each command imports what it needs: `verl-npu preflight` starts before doctor or rich load
    import subprocess

    from rich.console import Console
    from rich.table import Table


def _console() -> Console:
    from rich.console import Console

    return Console(soft_wrap=False, width=max(Console().width, 120))


def versions_table(stack: Stack, target: str | None = None) -> Table:
    from rich.table import Table

    table = Table(title=f"verl-npu stack ({stack.path.name}, Python {stack.python})")
    table.add_column("component", overflow="fold")
    table.add_column("version / ref", overflow="fold")
    table.add_column("commit", min_width=40, overflow="fold")  # a full commit always fits on one line
    table.add_column("targets", overflow="fold")
    for chip in stack.chips.values():
        if target in (None, chip.name):
            table.add_row(
                f"CANN base image ({chip.name})", chip.base_image, f"SOC_VERSION={chip.soc_version}", chip.name
            )
    for pkg in stack.packages.values():
        if target is None or target in pkg.targets:
            source = f" (index {pkg.index})" if pkg.index else ""
            table.add_row(pkg.name, pkg.version + source, "PyPI" if not pkg.index else "", ", ".join(pkg.targets))
    for comp in stack.git.values():
        if target is None or target in comp.targets:
            commit = comp.commit if comp.verified else "[yellow]UNVERIFIED[/] (resolved at build time)"
            table.add_row(comp.name, f"{comp.url} @ {comp.ref}", commit, ", ".join(comp.targets))
    return table


def cmd_versions(args: argparse.Namespace) -> int:
    from verl_npu.stack import matrix

    stack = load_stack(args.manifest)
    if args.json:
        print(json.dumps(stack.to_dict(), indent=2, default=str))
    elif args.markdown:
        print(matrix.render_markdown(stack))
    else:
        _console().print(versions_table(stack, args.target))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from verl_npu.doctor.rules.platform import expected_npus

    # the options first, before any probing: a bad one is exit 2 naming the option, not the variable it replaces
    expect_npus = expected_npus("--expect-npus", args.expect_npus) if args.expect_npus is not None else None
    if args.report not in (None, "-"):
        from verl_npu import atomic

        why = atomic.output_problem(args.report)
        if why is not None:
            print(f"verl-npu doctor: --report {args.report}: {why}", file=sys.stderr)
            return 2
    from verl_npu import doctor

    probe = doctor.Probe.current()
    if args.site_packages:
        probe.sys_path = [str(Path(p).resolve()) for p in args.site_packages]
        probe.meta_path = []
    if args.build_manifest:
        probe.build_manifest_path = Path(args.build_manifest)
    probe.expect_npus = expect_npus
    layer = not args.no_layer and not args.site_packages  # the layer probe runs this interpreter
    stack = load_stack(args.manifest)
    report = doctor.diagnose(probe, stack, layer=layer, ray=not args.no_ray, target=args.target)
    if args.report is not None:
        from verl_npu.doctor import report as doctor_report

        text = doctor_report.render(report, probe, stack, layer_requested=layer)
        if args.report == "-":
            print(text, end="")
        else:
            doctor_report.write(text, Path(args.report))
            print(f"verl-npu doctor: report written to {args.report}", file=sys.stderr)
    elif args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = _console()
        console.print(report.table())
        console.print(report.summary())
    return 1 if report.failed else 0


def cmd_patches(args: argparse.Namespace) -> int:
    if args.markdown:
        from verl_npu import runtime_patches
        from verl_npu.patching.docs import render_markdown

        print(render_markdown(runtime_patches.ALL), end="")
        return 0
    from verl_npu.errors import CANNEnvironmentError, LoadOrderError, StackMismatchError
    from verl_npu.patching import PatchError

    try:
        from verl_npu import megatron_adaptor

        layer = megatron_adaptor.load()
        if not args.as_loaded:
            layer.import_patch_targets()
    except (StackMismatchError, LoadOrderError, CANNEnvironmentError, PatchError, ImportError) as exc:
        print(f"verl-npu: the runtime layer failed to load: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(layer.to_dict(), indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"verl-npu runtime patches in this process (platform {layer.platform})")
    for column in ("id", "target", "kind", "status", "detail"):
        table.add_column(column, overflow="fold")
    styles = {"applied": "green", "applied-with-warning": "yellow", "pending": "cyan", "skipped": "dim"}
    for record in layer.records():
        status = f"[{styles.get(record.status, '')}]{record.status}[/]"
        table.add_row(record.id, record.target, record.kind, status, record.detail)
    _console().print(table)
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from verl_npu import processes
    from verl_npu.preflight.worker import start_child

    # before anything else: the worker's import of verl is a cold check's critical path (docs/preflight.md)
    child = start_child()
    try:
        return _preflight(args, child)
    finally:
        if child.poll() is None:  # a bad option or launch: the worker was never asked
            processes.end_group(child, grace=0.5)


def _preflight(args: argparse.Namespace, child: subprocess.Popen[bytes]) -> int:
    from verl_npu.preflight import run_preflight
    from verl_npu.preflight.launch import LaunchError
    from verl_npu.preflight.pipeline import host_memory
    from verl_npu.preflight.report import output_path, plot, print_report, write_json
    from verl_npu.preflight.startup import read_rate

    # the options first, before any work: a bad one is exit 2 with nothing written
    host_memory_gib = host_memory(args.host_memory_gib)
    checkpoint_read_gbps = read_rate(args.checkpoint_read_gbps)
    json_path = output_path("--json", args.json) if args.json not in (None, "-") else None
    plot_path = output_path("--plot", args.plot, plot=True) if args.plot is not None else None

    env = {}
    for item in args.env or []:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            print(f"verl-npu preflight: --env {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        env[name] = value
    if args.overrides:
        script, extra = None, [a for a in [args.launch, *args.args] if a is not None]
    elif args.launch is None:
        print("verl-npu preflight: give a launch script, or --overrides followed by Hydra overrides", file=sys.stderr)
        return 2
    else:
        script, extra = args.launch, args.args
    try:
        report = run_preflight(
            script,
            extra,
            env=env,
            chip=args.chip,
            model_config=args.model_config,
            host_memory_gib=host_memory_gib,
            use_cache=not args.no_cache,
            checkpoint_read_gbps=checkpoint_read_gbps,
            child=child,
        )
    except (LaunchError, ValueError) as exc:
        print(f"verl-npu preflight: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print_report(report, _console())
        if json_path is not None:
            write_json(report, json_path)
    if plot_path is not None:
        try:
            plot(report, plot_path)
        except UserError as exc:  # atomic.OutputPathError: the path changed kind after the pre-check
            print(f"verl-npu preflight: --plot: {exc}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"verl-npu preflight: --plot: {exc}", file=sys.stderr)
    return 0 if report.verdict == "go" else 1


def cmd_ci_compare(args: argparse.Namespace) -> int:
    from verl_npu import atomic
    from verl_npu.ci import compare as cmp

    if args.json and not args.update:  # checked before any work: a gate must not lose its report at the end
        why = atomic.output_problem(args.json)
        if why is not None:
            print(f"verl-npu ci compare: --json {args.json}: {why}", file=sys.stderr)
            return 2
    try:
        if args.update:
            data = cmp.update_baseline(args.log, args.baseline, image=args.image, commit=args.commit)
            print(f"baseline {args.baseline} taken from {args.log}: " + ", ".join(
                f"{k}={v['value']:g}" for k, v in data["metrics"].items()))  # fmt: skip
            return 0
        baseline = cmp.read_baseline(args.baseline)
        rows = cmp.compare(args.log, baseline)
    except UserError as exc:  # CompareError, and InputError from the values it parses
        print(f"verl-npu ci compare: {_one_line(exc)}", file=sys.stderr)
        return 2
    first, last = baseline.window
    _console().print(cmp.table(rows, f"{baseline.job}: {args.log} vs {args.baseline} (steps {first}-{last})"))
    regressions = [r for r in rows if r.verdict != "ok"]
    if args.json:
        report = json.dumps({
            "job": baseline.job, "log": str(args.log), "baseline": str(args.baseline), "window": baseline.window,
            "rows": [dataclasses.asdict(r) for r in rows], "regressions": len(regressions),
        }, indent=2, allow_nan=False) + "\n"  # fmt: skip
        try:
            atomic.write_text(args.json, report)  # whole or not at all
        except OSError as exc:
            print(f"verl-npu ci compare: --json {args.json}: cannot write it ({exc.strerror or exc})", file=sys.stderr)
            return 2
    return 1 if regressions else 0


def cmd_ci_image_tag(args: argparse.Namespace) -> int:
    from verl_npu.ci.images import print_tag

    return print_tag(args, "verl-npu ci image-tag")


def contract_pins(stack: Stack) -> dict[str, str]:
    return {
        "mindspeed": stack.git["mindspeed"].commit,
        "vllm-ascend": stack.git["vllm-ascend"].commit,
        "torch-npu": stack.packages["torch-npu"].version,
        "vllm": stack.git["vllm"].version,
    }


def cmd_contracts_list(args: argparse.Namespace) -> int:
    from verl_npu import contracts
    from verl_npu.contracts.docs import render_markdown

    if args.markdown:
        print(render_markdown(contracts.ALL, contract_pins(load_stack(args.manifest))), end="")
        return 0
    from rich.table import Table

    table = Table(title="verl-npu contracts with the Ascend upstreams")
    for column in ("id", "where", "what we rely on"):
        table.add_column(column, overflow="fold")
    for c in contracts.ALL:
        table.add_row(c.id, f"{c.component}: {c.where}", c.relied_on)
    _console().print(table)
    return 0


def cmd_contracts_verify(args: argparse.Namespace) -> int:
    from verl_npu import atomic, contracts
    from verl_npu.contracts.verify import source_overrides, sources_for, verify

    # every option before any verifying: a wrong --source is bad input (exit 2), not "0 of N contracts hold"
    unknown = [name for name in args.component or () if name not in contracts.COMPONENTS]
    if unknown:
        print(f"verl-npu contracts verify: --component {', '.join(unknown)}: expected one of "
              f"{', '.join(contracts.COMPONENTS)}", file=sys.stderr)  # fmt: skip
        return 2
    components = list(dict.fromkeys(args.component or contracts.COMPONENTS))
    overrides = source_overrides(args.source or [], contracts.ALL, components)
    if args.json not in (None, "-"):
        why = atomic.output_problem(args.json)
        if why is not None:
            print(f"verl-npu contracts verify: --json {args.json}: {why}", file=sys.stderr)
            return 2
    sources = sources_for(overrides, components)
    results = verify(contracts.ALL, sources, components=components)
    # what only running MindSpeed shows, wherever it is installed (not for a --source tree, which cannot be imported)
    composed = composed_checks() if "mindspeed" in components and "mindspeed" not in overrides and sources.get(
        "mindspeed") is not None else []  # fmt: skip
    rows = [r.to_dict() for r in results] + composed
    failed = [r for r in rows if r["status"] != "ok"]
    if args.json == "-":
        print(json.dumps(rows, indent=2))
    else:
        from rich.table import Table

        table = Table(title=f"verl-npu contracts: {', '.join(components)}")
        for column in ("id", "where", "status", "detail"):
            table.add_column(column, overflow="fold")
        for row in rows:
            style = "green" if row["status"] == "ok" else "bold red"
            status = f"[{style}]{row['status']}[/]"
            table.add_row(row["id"], f"{row['component']}: {row['where']}", status, row["detail"])
        console = _console()
        console.print(table)
        console.print(f"{len(rows) - len(failed)} of {len(rows)} contracts hold")
        if args.json:
            atomic.write_text(args.json, json.dumps(rows, indent=2) + "\n")  # an OSError: exit 2 (main)
    return 1 if failed else 0


COMPOSED_TIMEOUT_S = 600
COMPOSED_WHERE = "composed: the engine's repatch, then MLATransformerConfig"


def composed_checks() -> list[dict]:
    """verl_npu.contracts.composed in a fresh process (importing MindSpeed patches megatron for good), as rows of
    the contracts table; a process that dies without its report is one failed row naming its exit."""
    from verl_npu import processes
    from verl_npu.contracts import composed

    def row(check_id: str, ok: bool, detail: str) -> dict:
        status = "ok" if ok else "failed"
        return {"id": check_id, "component": "mindspeed", "where": COMPOSED_WHERE, "status": status, "detail": detail}

    done = processes.run([sys.executable, "-m", "verl_npu.contracts.composed"], timeout=COMPOSED_TIMEOUT_S)
    try:
        reports = json.loads(str(done.stdout).strip().splitlines()[-1]) if done.returncode in (0, 1) else None
    except (ValueError, IndexError):
        reports = None
    if not isinstance(reports, list):
        last = next((line.strip() for line in reversed(str(done.stderr).splitlines()) if line.strip()), "")
        return [row(composed.CP_CONFIG, False, f"the check did not report ({done.describe()}): {last[:300]}")]
    return [row(r["id"], r["ok"], r["detail"]) for r in reports]


def cmd_upstream_fetch(args: argparse.Namespace) -> int:
    from verl_npu import upstream

    try:
        archive = upstream.fetch_mindspeed(Path(args.dest), load_stack(args.manifest))
    except OSError as exc:  # git missing, or the destination unwritable
        print(f"verl-npu upstream fetch: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {archive}\nuse it: export {upstream.MINDSPEED_SOURCE_ENV}={archive}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-npu", description="verl-npu: the Ascend NPU distribution of verl")
    parser.add_argument("--manifest", default=str(MANIFEST_PATH), help=argparse.SUPPRESS)
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error (anywhere on the line)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("versions", help="print the pinned stack (verl_npu/stack/stack.toml)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="print the README support matrix")
    p.add_argument("--target", choices=TARGETS, help="only the components installed on this target")
    p.set_defaults(func=cmd_versions)

    p = sub.add_parser("doctor", help="check this node's environment against the stack; exit 1 on any failure")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--site-packages",
        action="append",
        metavar="DIR",
        help="inspect these directories instead of this interpreter's sys.path (repeatable)",
    )
    p.add_argument("--build-manifest", metavar="FILE", help="build manifest to compare with (default: auto-detected)")
    p.add_argument(
        "--target",
        choices=("a2", "a3"),
        help="check against this target's stack where npu-smi does not say which it is (default: read the node; "
        "a node npu-smi shows as the other target fails); docs/hardware_detection.md",
    )
    p.add_argument("--no-layer", action="store_true", help="skip the runtime-layer checks (process and Ray worker)")
    p.add_argument("--no-ray", action="store_true", help="check the layer in a process but not in a Ray worker")
    p.add_argument(
        "--expect-npus",
        metavar="N",
        help="fail unless this node has N NPUs (default: $VERL_NPU_EXPECT_NPUS; CI jobs on NPU runners set it)",
    )
    p.add_argument(
        "--report",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write a Markdown report for an issue (versions, CANN/driver, NPUs, patches, env with secrets "
        "redacted, findings) to FILE, or stdout without FILE",
    )
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("patches", help="the runtime patches applied or skipped in this process")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="print docs/patches.md (generated from the registry)")
    p.add_argument(
        "--as-loaded",
        action="store_true",
        help="do not import the patch targets first (pending patches stay pending)",
    )
    p.set_defaults(func=cmd_patches)

    p = sub.add_parser(
        "preflight",
        help="check a launch (script or overrides) against verl's schema, the mesh and device memory; exit 0 = go",
    )
    p.add_argument("launch", nargs="?", help="a bash launch script (read, never run)")
    p.add_argument("args", nargs="*", help='the script\'s arguments ("$@"), or the overrides with --overrides')
    p.add_argument("--overrides", action="store_true", help="the positional arguments are Hydra overrides, no script")
    p.add_argument("--env", action="append", metavar="NAME=VALUE", help="environment the script starts with")
    p.add_argument("--chip", choices=("a2", "a3"), default="a3", help="device memory per NPU from the manifest")
    p.add_argument("--model-config", metavar="PATH|ID|glm5", help="HF config.json, model dir, cached id, or glm5")
    p.add_argument("--host-memory-gib", metavar="GIB", help="host RAM per node to check against (> 0)")
    p.add_argument(
        "--checkpoint-read-gbps",
        metavar="GBPS",
        help="GB/s one node reads the checkpoint's storage at (> 0): estimates the load and the HCCL timeouts it needs",
    )
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-': JSON on stdout only)")
    p.add_argument("--plot", metavar="FILE.png", help="stacked HBM bar per pipeline stage")
    p.add_argument("--no-cache", action="store_true", help="recompute verl's validation and the model config")
    p.set_defaults(func=cmd_preflight)

    contracts = sub.add_parser(
        "contracts", help="facts verl-npu relies on in MindSpeed, vllm-ascend, torch-npu and vLLM"
    )
    contracts_sub = contracts.add_subparsers(dest="contracts_command", required=True)
    p = contracts_sub.add_parser("list", help="the recorded contracts")
    p.add_argument("--markdown", action="store_true", help="print docs/ascend_contracts.md (generated)")
    p.set_defaults(func=cmd_contracts_list)
    p = contracts_sub.add_parser(
        "verify", help="check the contracts against the installed sources (or --source dirs); exit 1 on any drift"
    )
    p.add_argument(
        "--source",
        action="append",
        metavar="NAME=DIR",
        help="check this source tree (checkout, unpacked wheel or sdist) for NAME instead of the installed one",
    )
    p.add_argument("--component", action="append", metavar="NAME",
                   help="only this component, e.g. mindspeed (repeatable; default: all)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': JSON on stdout only)")
    p.set_defaults(func=cmd_contracts_verify)

    upstream = sub.add_parser(
        "upstream", help="pinned upstream sources not on PyPI (MindSpeed), for the ascend_sim tests"
    )
    upstream_sub = upstream.add_subparsers(dest="upstream_command", required=True)
    p = upstream_sub.add_parser(
        "fetch", help="fetch the pinned MindSpeed commit (gitcode) into DEST/MindSpeed-<commit>.tar.gz"
    )
    p.add_argument("component", choices=["mindspeed"], help="the upstream source to fetch")
    p.add_argument("--dest", default=".", help="directory to write the archive to (default: the current directory)")
    p.set_defaults(func=cmd_upstream_fetch)

    ci = sub.add_parser("ci", help="CI tools: compare a training log with a baseline; image tags")
    ci_sub = ci.add_subparsers(dest="ci_command", required=True)
    p = ci_sub.add_parser("compare", help="windowed metric averages of a verl log vs a baseline; exit 1 on regression")
    p.add_argument("log", help="verl training log (console output or file-logger JSONL)")
    p.add_argument("baseline", help="baseline JSON (ci/baselines/<job>.json)")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.add_argument("--update", action="store_true", help="write the baseline's values from this log instead")
    p.add_argument("--image", help="with --update: the image tag the log was produced with")
    p.add_argument("--commit", help="with --update: the commit the log was produced with")
    p.set_defaults(func=cmd_ci_compare)
    p = ci_sub.add_parser("image-tag", help="the image tag for a chip and commit (manifest hash + git sha)")
    from verl_npu.ci.images import add_arguments as image_tag_arguments

    image_tag_arguments(p)
    p.set_defaults(func=cmd_ci_image_tag)

    from verl_npu.k8s.cli import register as register_k8s
    from verl_npu.parity.cli import register as register_parity

    register_k8s(sub)
    register_parity(sub)
    return parser


EXIT_USAGE = 2  # a bad input: the message names the key, file or value and the fix (docs/errors.md)
EXIT_INTERNAL = 3  # a bug in verl-npu: a short message; --debug shows the traceback


def _command_name(args: argparse.Namespace) -> str:
    words = [args.command, getattr(args, "ci_command", None), getattr(args, "contracts_command", None),
             getattr(args, "k8s_command", None), getattr(args, "parity_command", None)]  # fmt: skip
    return " ".join(["verl-npu", *(w for w in words if w)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)  # after "--" it is a launch script's own argument
    debug = "--debug" in argv[:end]  # accepted anywhere before that, not only before the command
    args = build_parser().parse_args([a for i, a in enumerate(argv) if a != "--debug" or i >= end])
    args.debug = debug
    try:
        return args.func(args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"{_command_name(args)}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{_command_name(args)}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file the user named cannot be read or written: their input, not our bug
        if args.debug:
            raise
        print(f"{_command_name(args)}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if args.debug:
            raise
        print(f"{_command_name(args)}: internal error: {type(exc).__name__}: {_one_line(exc)}\n"
              "  this is a verl-npu bug; run the same command with --debug for the traceback and report it",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERNAL


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:1997] + "..."


if __name__ == "__main__":
    sys.exit(main())
