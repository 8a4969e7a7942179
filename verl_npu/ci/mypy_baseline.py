"""mypy over verl_npu/ against a baseline of the errors it had when the gate came in; the baseline may only shrink.

    python -m verl_npu.ci.mypy_baseline                # the check .ci/run makes
    python -m verl_npu.ci.mypy_baseline --write        # drop the fixed entries from the baseline
    python -m verl_npu.ci.mypy_baseline --write --allow-new   # also record new errors (say why in the commit)

From the repository root (or with ``--root``), mypy runs with pyproject.toml's ``[tool.mypy]`` (its ``files``
say what it checks) and writes JSON lines (``-O json``). Each error becomes one baseline entry,
``<file>: [<code>] <message>``, without its line and column, and with any line number inside the message written
as ``line N``: an edit that only moves code leaves the baseline as it is. The baseline (:data:`BASELINE`) holds
one entry a line, sorted, an error that occurs twice twice; lines starting with ``#`` are comments.

The check fails (exit 1) when mypy reports an error the baseline does not hold (fix it; the baseline is no
place for new code) and when a baseline entry no longer occurs (remove it: ``--write`` does). ``--write``
refuses to add an entry unless ``--allow-new`` is given, and never adds one for a file of :data:`KEPT_CLEAN`,
the modules that reached zero errors. Exit 2: mypy did not finish (a syntax error, a bad configuration),
or the baseline cannot be read.

Why not the mypy-baseline package: it compares the same way, but names no stale entry (it counts them) and its
``sync`` writes whatever mypy reports, new errors included.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from verl_npu import atomic, processes

BASELINE = Path("ci/mypy_baseline.txt")  # relative to the root mypy runs in
# Modules that reached zero mypy errors (issue 32's): no baseline entry may name them, not even with --allow-new.
KEPT_CLEAN = (
    "verl_npu/pipeline_split.py",
    "verl_npu/ops/fused_dsa_rules.py",
    "verl_npu/ops/ascend.py",
    "verl_npu/preflight/target.py",
    "verl_npu/parity/run_format.py",
    "verl_npu/parity/job.py",
    "verl_npu/cluster/network.py",
    "verl_npu/doctor/rules/network.py",
    "verl_npu/k8s/render.py",
    "verl_npu/engine/index_share.py",
    "verl_npu/engine/bridges/fast_read.py",
    "verl_npu/safetensors_header.py",
    "verl_npu/runtime_patches/mbridge_instance_mapping.py",
    "verl_npu/runtime_patches/dsa_index_share.py",
    "verl_npu/models/family.py",
    "verl_npu/models/glm5/config.py",
    "verl_npu/models/glm5/family.py",
    "verl_npu/models/glm5/names.py",
    "verl_npu/preflight/compose.py",
    "verl_npu/preflight/verl_validation.py",
    "verl_npu/preflight/engine_checks.py",
    "verl_npu/preflight/model_shape.py",
    "verl_npu/preflight/model.py",
    "verl_npu/preflight/worker.py",
    "verl_npu/preflight/pipeline.py",
    "verl_npu/parity/models.py",
    "verl_npu/parallelism.py",
    "verl_npu/preflight/mesh.py",
    "verl_npu/stack/drift.py",
    "verl_npu/ci/mypy_baseline.py",
    "verl_npu/engine/build_plan.py",
    "verl_npu/preflight/memory.py",
    "verl_npu/preflight/memory_plan.py",
    "verl_npu/preflight/startup.py",
    "verl_npu/preflight/values.py",
)
HEADER = (
    "# mypy errors verl_npu/ had when the check came in: this list may only shrink.\n"
    "# Check: python -m verl_npu.ci.mypy_baseline; drop fixed entries: python -m verl_npu.ci.mypy_baseline --write\n"
)
MYPY_TIMEOUT_S = 1800.0  # a cold run takes about a minute on 2 CPUs
_LINE_IN_MESSAGE = re.compile(r"\bline \d+\b")


class MypyDidNotFinish(Exception):
    """mypy stopped before checking everything: its verdict cannot be compared with the baseline."""


@dataclasses.dataclass(frozen=True)
class MypyError:
    file: str
    line: int
    code: str
    message: str

    @property
    def entry(self) -> str:
        """The baseline's form: no position, so that moving code does not change it."""
        return f"{self.file}: [{self.code}] {_LINE_IN_MESSAGE.sub('line N', self.message)}"

    @property
    def located(self) -> str:
        return f"{self.file}:{self.line}: error: {self.message}  [{self.code}]"


def parse_mypy_json(stdout: str) -> list[MypyError]:
    """mypy's ``-O json`` lines -> its errors (notes, such as reveal_type's, are no errors)."""
    errors = []
    for number, text in enumerate(stdout.splitlines(), 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            severity, file, line, message = record["severity"], record["file"], record["line"], record["message"]
        except (ValueError, TypeError, KeyError) as exc:
            raise MypyDidNotFinish(
                f"mypy printed something other than an error record on line {number} of its output "
                f"(a note on the configuration?): {text[:300]!r}; fix what it says ({exc})"
            ) from None
        if severity == "error":
            errors.append(MypyError(file.replace("\\", "/"), int(line), record.get("code") or "misc", message))
    return errors


def read_baseline(path: Path) -> collections.Counter[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return collections.Counter()
    return collections.Counter(line for line in text.splitlines() if line.strip() and not line.startswith("#"))


def render_baseline(entries: collections.Counter[str]) -> str:
    return HEADER + "".join(entry + "\n" for entry in sorted(entries.elements()))


@dataclasses.dataclass(frozen=True)
class Verdict:
    new: list[MypyError]  # errors beyond what the baseline holds
    gone: list[str]  # baseline entries that no longer occur (one per surplus occurrence)
    in_clean: list[str]  # baseline entries that name a KEPT_CLEAN file

    @property
    def ok(self) -> bool:
        return not (self.new or self.gone or self.in_clean)


def compare(
    errors: Sequence[MypyError], baseline: collections.Counter[str], clean: Iterable[str] = KEPT_CLEAN
) -> Verdict:
    remaining = baseline.copy()
    new = []
    for error in errors:
        if remaining[error.entry] > 0:
            remaining[error.entry] -= 1
        else:
            new.append(error)
    clean_files = set(clean)
    in_clean = sorted(e for e in baseline.elements() if e.partition(":")[0] in clean_files)
    return Verdict(new, sorted(remaining.elements()), in_clean)


def report(verdict: Verdict, baseline_path: Path) -> str:
    lines = []
    if verdict.new:
        lines.append(f"mypy: {len(verdict.new)} error(s) that {baseline_path} does not hold:")
        lines += [f"  {error.located}" for error in verdict.new]
        lines.append(
            "  fix them: the baseline holds only errors older than the check. Where a third-party stub is wrong, "
            "a `# type: ignore[<code>]` on that line, with the reason beside it, is the fix."
        )
    if verdict.gone:
        lines.append(f"mypy: {len(verdict.gone)} entry(ies) of {baseline_path} no longer occur(s):")
        lines += [f"  {entry}" for entry in verdict.gone]
        lines.append(
            f"  remove them from {baseline_path} (the baseline may only shrink): "
            "python -m verl_npu.ci.mypy_baseline --write"
        )
    if verdict.in_clean:
        lines.append(f"mypy: {baseline_path} names modules that must stay free of mypy errors (KEPT_CLEAN):")
        lines += [f"  {entry}" for entry in verdict.in_clean]
        lines.append("  fix those errors and remove their entries; a module of KEPT_CLEAN has no baseline.")
    return "\n".join(lines)


def run_mypy(root: Path) -> list[MypyError]:
    """mypy as pyproject.toml configures it, in ``root``; raises MypyDidNotFinish when it stops short."""
    done = processes.run([sys.executable, "-m", "mypy", "-O", "json"], cwd=root, timeout=MYPY_TIMEOUT_S)
    stdout, stderr = processes.decode(done.stdout), processes.decode(done.stderr)
    if done.timed_out:
        raise MypyDidNotFinish(f"mypy did not finish within {MYPY_TIMEOUT_S:g} s (its process group was ended)")
    if done.returncode not in (0, 1):  # 2: a blocking error (syntax, configuration): the rest went unchecked
        raise MypyDidNotFinish(
            f"mypy exited with status {done.returncode} before checking everything; its output:\n"
            f"{stdout}{stderr}".rstrip()
        )
    errors = parse_mypy_json(stdout)
    if done.returncode == 1 and not errors:
        raise MypyDidNotFinish(f"mypy exited with status 1 and reported no error:\n{stdout}{stderr}".rstrip())
    return errors


def check(errors: Sequence[MypyError], baseline_path: Path) -> int:
    verdict = compare(errors, read_baseline(baseline_path))
    if verdict.ok:
        print(f"mypy: {len(errors)} error(s), each in {baseline_path}; nothing new, nothing stale")
        return 0
    print(report(verdict, baseline_path))
    return 1


def write(errors: Sequence[MypyError], baseline_path: Path, *, allow_new: bool) -> int:
    """Rewrite the baseline to today's errors; refuses new entries unless allowed, and any for KEPT_CLEAN."""
    verdict = compare(errors, read_baseline(baseline_path))
    in_clean = [error for error in errors if error.file in KEPT_CLEAN]
    if in_clean:
        print(f"mypy: not writing {baseline_path}: these modules must stay free of mypy errors (KEPT_CLEAN):")
        print("\n".join(f"  {error.located}" for error in in_clean))
        print("  fix those errors; no flag records them.")
        return 1
    if verdict.new and not allow_new:
        print(f"mypy: not writing {baseline_path}: it would gain these entries")
        print("\n".join(f"  {error.located}" for error in verdict.new))
        print("  fix them; to record them all the same (say why in the commit), add --allow-new.")
        return 1
    entries = collections.Counter(error.entry for error in errors)
    atomic.write_text(baseline_path, render_baseline(entries))
    print(
        f"mypy: wrote {baseline_path}: {sum(entries.values())} entries "
        f"({len(verdict.gone)} removed, {len(verdict.new)} added)"
    )
    return 0


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m verl_npu.ci.mypy_baseline", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--write", action="store_true", help="rewrite the baseline to today's errors")
    parser.add_argument("--allow-new", action="store_true", help="with --write: also record errors it lacks")
    parser.add_argument(
        "--root", type=Path, default=Path("."), help="where mypy runs, with its pyproject.toml (default: here)"
    )
    parser.add_argument("--baseline", type=Path, help=f"the baseline file (default: ROOT/{BASELINE})")
    args = parser.parse_args(argv)
    if args.allow_new and not args.write:
        parser.error("--allow-new goes with --write")
    root = args.root.resolve()
    baseline_path = args.baseline.resolve() if args.baseline is not None else root / BASELINE
    if baseline_path.is_relative_to(root):  # say ci/mypy_baseline.txt, as a reader of the repository sees it
        baseline_path = baseline_path.relative_to(root)
    try:
        errors = run_mypy(root)
        with contextlib.chdir(root):  # mypy's paths, and the baseline's, are relative to the root
            if args.write:
                return write(errors, baseline_path, allow_new=args.allow_new)
            return check(errors, baseline_path)
    except (MypyDidNotFinish, OSError, UnicodeDecodeError, atomic.OutputPathError) as exc:  # the baseline's I/O
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(_main())
