"""``python -m verl_npu.stack``: the manifest for install.sh (plan, constraints, JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from verl_npu.stack.manifest import MANIFEST_PATH, TARGETS, StackError, load_stack
from verl_npu.stack.plan import install_plan


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    try:
        stack = load_stack(args.manifest)
        if args.command == "plan":
            for step in install_plan(stack, args.target, dev_tools=args.dev):
                print(step.line())
        elif args.command == "constraints":
            if args.target not in TARGETS:
                raise StackError(f"unknown target {args.target!r}; valid targets: {', '.join(TARGETS)}")
            print("\n".join(stack.constraints(args.target)))
        else:
            print(json.dumps(stack.to_dict(), indent=2, default=str))
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
