"""``python -m verl_npu.stack``: the manifest for install.sh (plan, constraints, JSON) and the node's target.

install.sh runs it with a bare Python before anything is installed: standard library only.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from verl_npu.errors import UserError
from verl_npu.stack.detect import UnknownChipError, detect_target
from verl_npu.stack.manifest import MANIFEST_PATH, TARGETS, StackError, load_stack
from verl_npu.stack.plan import install_plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl_npu.stack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the install plan for a target, one step per line")
    plan.add_argument("--target", required=True)
    plan.add_argument("--dev", action="store_true", help="include the test tools")
    plan.add_argument("--manifest", default=str(MANIFEST_PATH))
    cons = sub.add_parser("constraints", help="print pip constraints for a target")
    cons.add_argument("--target", required=True)
    cons.add_argument("--manifest", default=str(MANIFEST_PATH))
    show = sub.add_parser("json", help="print the validated manifest as JSON")
    show.add_argument("--manifest", default=str(MANIFEST_PATH))
    sub.add_parser("detect-target", help="print this node's target (a2, a3 or dev) from npu-smi")
    build = sub.add_parser(
        "build-requires", help="print a checkout's [build-system] requires, one a line (a build without isolation)"
    )
    build.add_argument("pyproject", help="the checkout's pyproject.toml")
    build.add_argument("--skip", default="", help="comma-separated distributions to leave out (the stack has them)")
    drift = sub.add_parser(
        "drift", help="every reference in a checkout that disagrees with the manifest (exit 1 if any)"
    )
    drift.add_argument("--repo", default=None, help="the checkout to scan (default: this one)")
    drift.add_argument("--manifest", default=str(MANIFEST_PATH))
    return parser


def _manifest_command(args: argparse.Namespace) -> int:
    stack = load_stack(args.manifest)
    if args.command == "plan":
        for step in install_plan(stack, args.target, dev_tools=args.dev):
            print(step.line())
    elif args.command == "drift":
        from pathlib import Path

        from verl_npu.stack.drift import find_drift
        from verl_npu.stack.manifest import REPO_ROOT

        root = Path(args.repo) if args.repo else REPO_ROOT
        if not root.is_dir():
            raise StackError(f"--repo {root}: not a directory")
        drifts = find_drift(stack, root)
        for drift in drifts:
            print(drift)
        print(f"{len(drifts)} reference(s) disagree with {args.manifest}", file=sys.stderr)
        return 1 if drifts else 0
    elif args.command == "constraints":
        if args.target not in TARGETS:
            raise StackError(f"unknown target {args.target!r}; valid targets: {', '.join(TARGETS)}")
        print("\n".join(stack.constraints(args.target)))
    else:
        print(json.dumps(stack.to_dict(), indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build-requires":
            from verl_npu.stack.build_requires import build_requirements

            for requirement in build_requirements(args.pyproject, [n for n in args.skip.split(",") if n]):
                print(requirement)
        elif args.command == "detect-target":
            # install.sh bounds this with `timeout`, whose SIGTERM must still end npu-smi's process group
            # (verl_npu.processes ends it when the wait is interrupted by an exception)
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            print(detect_target())
        else:
            return _manifest_command(args)
    except UserError as exc:  # a bad option, manifest or variable (VERL_NPU_PROBE_TIMEOUT_S): nothing was judged
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except UnknownChipError as exc:  # the node was read and is not one verl-npu has a stack for: a finding
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
