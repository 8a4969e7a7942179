"""Compare a verl training log with a versioned baseline: windowed averages, per-metric limits, a verdict.

Reads the two formats verl 0.9.1 writes per step: the console logger's lines
(``step:N - key:value - ...``, verl.utils.logger.aggregate_logger.concat_dict_to_str, possibly
prefixed by Ray's ``(TaskRunner pid=...)``) and the file logger's JSON lines
(``{"step": N, "data": {...}}``, verl.utils.tracking.FileLogger). Averages each baseline metric
over the baseline's window of steps (upstream's gate: steps 5-14) and checks it against the
baseline's limit for that metric:

- ``absolute``: ``max_increase`` / ``max_decrease`` / ``tolerance`` in the metric's unit
  (memory +1 GB, reward mean +-0.05);
- ``relative``: the same as fractions of the baseline value (throughput -5%, step time +5%).

A baseline may also hold ``guards``: a bound on one metric at one step that needs no baseline value, so it holds
from a job's first night. The GLM-5 jobs bound verl's rollout-vs-actor probability difference at step 1
(:data:`DEFAULT_GUARDS`): a rollout left with wrong weights by the weight sync samples from another model than the
one the actor scores, from the first step on. A guard that fails is a regression (exit 1) even while the baseline's
values are not taken yet; one whose metric is missing or not finite at its step fails closed (exit 2).

The gate fails closed: a baseline value or limit that is not a finite number in range, a window with
a NaN or infinite value, or a metric missing from any step of the window is an error (exit 2), never
"ok". The baseline's structure is parsed through verl_npu.inputs; ``--update`` writes it atomically
(a temporary file beside it, fsync, rename) and refuses a value that is not finite.

Nor does the gate choose between two values (exit 2 instead, naming both): a metric given two different values
at one step (a restarted run appended to the same log), a key given twice in one JSON object (``json.loads``
keeps the last), a limit with both ``tolerance`` and ``max_increase``. A baseline key the gate does not know
(a misspelt ``tolerence`` would be ignored) and a ``format`` other than :data:`BASELINE_FORMAT` are refused;
every text ``--update`` writes from outside (``--image``, ``--commit``, the log's name) is one line of printable
characters, an image a reference in the OCI distribution grammar, so a shell reading it back gets what was meant.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import unicodedata
from pathlib import Path
from typing import Any

from verl_npu import atomic, inputs
from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.checks import FAIL, OK, Check, Column, status_markup
from verl_npu.checks import table as checks_table
from verl_npu.errors import UserError
from verl_npu.inputs import DuplicateKey, InputError, loads_json

MAX_LOG_BYTES = 512 * MIB  # a training log
MAX_BASELINE_BYTES = 16 * MIB

_CONSOLE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
# what Python prints for a number: ASCII digits (float() also reads other scripts' digits, '1_000' and ' 1 ')
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|[+-]?(?:nan|inf|infinity)",
                      re.ASCII | re.IGNORECASE)  # fmt: skip
LIMIT_KINDS = ("absolute", "relative")
LIMIT_KEYS = ("max_increase", "max_decrease", "tolerance")

# upstream's nightly gate (verl NPU CI, 2026-08): metric -> (kind, key, amount)
DEFAULT_LIMITS = {
    "perf/max_memory_allocated_gb": ("absolute", "max_increase", 1.0),
    "perf/throughput": ("relative", "max_decrease", 0.05),
    "timing_s/step": ("relative", "max_increase", 0.05),
    "critic/rewards/mean": ("absolute", "tolerance", 0.05),
    "training/rollout_probs_diff_mean": ("relative", "max_increase", 0.05),
}
DEFAULT_WINDOW = (5, 14)

# verl 0.9.1's rollout-vs-actor metric (verl/utils/debug/metrics.py, calculate_debug_metrics; logged each step when
# actor_rollout_ref.rollout.calculate_log_probs=True): the mean over response tokens of |p_actor - p_rollout|, the
# probabilities both give the sampled token. Bounded at step 1, before training has moved the actor: a right sync
# leaves bf16 kernel differences only (2e-4 measured for the nightly's random-weight GLM-5 model; trained models
# stay near 0.01), while a rollout that reads garbage weights samples tokens it is sure of and the actor is not.
# ci/README.md ("The step-1 guard") gives the measurements, and what this bound cannot see.
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
DEFAULT_GUARDS = {PROBS_DIFF_MEAN: {"step": 1, "max": 0.05}}
GUARD_KEYS = ("step", "min", "max", "why")

# Bounds no real job comes near; they keep every bound and mean finite and every loop short.
MAX_STEP = 10_000_000
MAX_WINDOW = 100_000  # steps in one window
MAX_METRICS = 1_000
MAX_VALUE = 1e15  # |a baseline value|, and an absolute limit
MAX_RELATIVE = 100.0  # a relative limit: 10000% of the baseline value
MAX_NAME = 200  # a metric or job name
MAX_TEXT = 2_000  # a baseline's description, a guard's why

BASELINE_FORMAT = 1  # a baseline without "format" is format 1
BASELINE_KEYS = ("format", "job", "description", "image", "commit", "taken", "source_log", "window", "metrics",
                 "guards")  # fmt: skip
WINDOW_KEYS = ("first_step", "last_step")
METRIC_KEYS = ("value", "limit")

# An image reference as registries and `docker pull` read it (the OCI distribution reference grammar): an optional
# registry host[:port], lowercase path components joined by one of . _ __ or dashes, an optional :tag of up to 128
# word characters, an optional @algorithm:hex digest.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[0-9A-Fa-f:.]+\])"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?",
    re.ASCII,
)
MAX_IMAGE = 512  # a name of at most 255 characters, a tag of 128, a sha512 digest
# a commit or revision as git names one (a sha, HEAD, v1.2, "unknown" from run_job.sh): no shell or control character
COMMIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}", re.ASCII)
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", re.ASCII)


class CompareError(UserError):
    """A log or baseline that cannot be compared (names the file, line or metric and the fix)."""


# --- JSON and text from outside ------------------------------------------------------------------
# line and paragraph breaks, other control characters, bidirectional overrides, lone surrogates
_NOT_ONE_LINE = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))


def label(key: str, value: Any, *, max_length: int = MAX_NAME, source: str | None = None) -> str:
    """Text of one line: no character that a terminal, a shell or a YAML reader would take as more than text."""
    text = inputs.text(key, value, max_length=max_length, source=source)
    bad = next((c for c in text if unicodedata.category(c) in _NOT_ONE_LINE), None)
    if bad is not None:
        raise InputError(key, value, f"one line of printable text (it holds {bad!r})", source=source)
    return text


# --- reading the log -----------------------------------------------------------------------------
def _number(text: str) -> float:
    text = text.strip()
    match = _NUMPY_SCALAR.match(text)
    if match:
        text = match.group(1)
    if text in ("True", "False"):
        return float(text == "True")
    if not _DECIMAL.fullmatch(text):
        raise ValueError(text)
    return float(text)


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond a double: not a finite measurement
        return math.inf if value > 0 else -math.inf


def _step(path: Path, number: int, value: Any, *, console: bool = False) -> int:
    """A step: ASCII digits on a console line, a JSON integer on a JSON line (not "1", 1.0 or true)."""
    source = f"{path}:{number}"
    try:
        if console:
            return inputs.integer("step", value, minimum=0, maximum=MAX_STEP, source=source)
        return _json_integer("step", value, minimum=0, maximum=MAX_STEP, source=source)
    except InputError as exc:
        raise CompareError(str(exc)) from None


Record = tuple[int, list[tuple[str, float]]]  # a step and its (metric, value) pairs, in the order written


def _console_line(path: Path, number: int, line: str, last: bool) -> Record | None:
    match = _CONSOLE.search(line)
    if not match:
        return None
    digits = match.group(1)
    step, metrics = _step(path, number, digits if len(digits) <= 40 else digits[:40] + "...", console=True), []
    again = _CONSOLE.search(match.group(2))
    if again:  # two processes' lines run together: which step a value belongs to is a guess
        second = again.group(1)[:40]
        raise CompareError(f"{path}:{number}: two step records on one line (step {step} and step {second}); put "
                           "each on its own line")  # fmt: skip
    for item in match.group(2).split(" - "):
        key, sep, value = item.rpartition(":")
        try:
            if not sep or not key:
                raise ValueError(item)
            metrics.append((key.strip(), _number(value)))
        except ValueError:
            what = "truncated (the last line ends mid-record)" if last else "malformed"
            raise CompareError(f"{path}:{number}: {what}: cannot read {item!r} as key:value") from None
    return step, metrics


def _json_line(path: Path, number: int, line: str, last: bool) -> Record:
    try:
        record = loads_json(line)
    except DuplicateKey as exc:
        raise CompareError(f"{path}:{number}: {exc}") from None
    except (ValueError, RecursionError):  # JSONDecodeError, and integers of more than 4300 digits
        what = "truncated (the last line ends mid-record)" if last else "malformed JSON"
        raise CompareError(f"{path}:{number}: {what}") from None
    if not isinstance(record, dict) or "step" not in record or not isinstance(record.get("data"), dict):
        raise CompareError(f'{path}:{number}: a JSON line must be {{"step": N, "data": {{...}}}}')
    step = _step(path, number, record["step"])
    return step, [(k, _as_float(v)) for k, v in record["data"].items() if _is_number(v)]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


class _Steps:
    """Metrics per step, and the line each value came from: a second, different value is refused, not kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[int, dict[str, float]] = {}
        self.lines: dict[int, dict[str, int]] = {}

    def add(self, number: int, step: int, metrics: list[tuple[str, float]]) -> None:
        values, lines = self.values.setdefault(step, {}), self.lines.setdefault(step, {})
        for key, value in metrics:
            if key not in values:
                values[key], lines[key] = value, number
            elif not _same(values[key], value):
                raise CompareError(self._two_values(step, key, (values[key], lines[key]), (value, number)))

    def _two_values(self, step: int, key: str, first: tuple[float, int], second: tuple[float, int]) -> str:
        if first[1] == second[1]:
            return (f"{self.path}:{second[1]}: step {step} gives {key[:80]!r} two values on one line "
                    f"({first[0]:.6g} and {second[0]:.6g})")  # fmt: skip
        return (f"{self.path}: step {step} gives {key[:80]!r} two values: {first[0]:.6g} at line {first[1]} and "
                f"{second[0]:.6g} at line {second[1]} (a restarted run appended to the same log?); compare the log "
                "of one run (split the log where its steps start again)")  # fmt: skip


def read_log(path: str | Path) -> dict[int, dict[str, float]]:
    """Metrics per step from a verl console log or file-logger JSONL (the format is detected per line)."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path}: no such log file")
    try:
        lines = read_bytes(path, MAX_LOG_BYTES).decode("utf-8", errors="replace").splitlines()
    except NotReadable as exc:
        raise CompareError(f"{path}: cannot read the log ({exc})") from None
    steps = _Steps(path)
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)
        if line.lstrip().startswith("{"):
            entry = _json_line(path, number, line, last)
        else:
            entry = _console_line(path, number, line, last)
            if entry is None:
                continue
        steps.add(number, *entry)
    if not steps.values:
        raise CompareError(
            f"{path}: no per-step metric lines (expected verl's console 'step:N - key:value' lines or its file "
            "logger's JSON lines); was the job run with trainer.logger containing 'console' or 'file'?"
        )
    return steps.values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def window_average(steps: dict[int, dict[str, float]], metric: str, window: tuple[int, int], log: str) -> float:
    first, last = window
    wanted = range(first, last + 1)
    present = [s for s in wanted if s in steps]
    if len(present) < len(wanted):
        have = f"steps {min(steps)}..{max(steps)}"
        raise CompareError(
            f"{log}: the window needs steps {first}-{last} and the log has {have} (missing "
            f"{[s for s in wanted if s not in steps][:5]}...); run at least {last} steps"
        )
    lacking = [s for s in wanted if metric not in steps[s]]
    if lacking:
        raise CompareError(
            f"{log}: metric {metric!r} is missing at steps {lacking[:10]} of the window {first}-{last} "
            "(a gate does not pass on what it did not measure)"
        )
    values = [steps[s][metric] for s in wanted]
    bad = [s for s, v in zip(wanted, values, strict=True) if not math.isfinite(v)]
    if bad:
        raise CompareError(
            f"{log}: metric {metric!r} is nan/inf at steps {bad[:10]} of the window {first}-{last} "
            "(a gate does not pass on a value that is not a number)"
        )
    mean = sum(v / len(values) for v in values)  # divided first: a sum of large finite values may overflow
    if not math.isfinite(mean):
        raise CompareError(f"{log}: metric {metric!r} has no finite mean over the window {first}-{last}")
    return mean


# --- the baseline ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limit:
    kind: str
    max_increase: float | None = None
    max_decrease: float | None = None
    tolerance: float | None = None

    def bounds(self, baseline: float) -> tuple[float | None, float | None]:
        scale = abs(baseline) if self.kind == "relative" else 1.0
        up = self.tolerance if self.tolerance is not None else self.max_increase
        down = self.tolerance if self.tolerance is not None else self.max_decrease
        return (
            baseline - down * scale if down is not None else None,
            baseline + up * scale if up is not None else None,
        )

    def describe(self) -> str:
        unit = "%" if self.kind == "relative" else ""
        factor = 100 if self.kind == "relative" else 1
        if self.tolerance is not None:
            return f"+-{self.tolerance * factor:g}{unit}"
        parts = []
        if self.max_increase is not None:
            parts.append(f"+{self.max_increase * factor:g}{unit}")
        if self.max_decrease is not None:
            parts.append(f"-{self.max_decrease * factor:g}{unit}")
        return " / ".join(parts)


def _json_number(key: str, value: Any, *, minimum: float, maximum: float, source: str) -> float:
    """A JSON number (not text that reads as one: a baseline's values are numbers) that is finite and in range."""
    if isinstance(value, str):
        raise InputError(key, value, "a JSON number, not a string", source=source)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > maximum:  # also beyond a double
        raise InputError(key, value, f"a finite number from {minimum:g} to {maximum:g}", source=source)
    return inputs.number(key, value, minimum=minimum, maximum=maximum, source=source)


def _json_integer(key: str, value: Any, *, minimum: int, maximum: int, source: str) -> int:
    if isinstance(value, str):
        raise InputError(key, value, "a JSON integer, not a string", source=source)
    return inputs.integer(key, value, minimum=minimum, maximum=maximum, source=source)


def _limit(path: Path, metric: str, data: Any) -> Limit:
    where = f"{path}: metrics.{metric}.limit"
    if not isinstance(data, dict) or data.get("kind") not in LIMIT_KINDS:
        raise CompareError(f"{where}: needs kind = {' or '.join(LIMIT_KINDS)}")
    unknown = set(data) - {"kind", *LIMIT_KEYS}
    if unknown:
        raise CompareError(f"{where}: unknown keys {sorted(unknown)[:10]} (allowed: kind, {', '.join(LIMIT_KEYS)})")
    present = [k for k in LIMIT_KEYS if k in data]
    if not present:
        raise CompareError(f"{where}: give one or more of {', '.join(LIMIT_KEYS)} as non-negative numbers")
    if "tolerance" in present and len(present) > 1:  # tolerance would win over the other without a word
        raise CompareError(f"{where}: tolerance bounds both ways: give it alone, or max_increase and/or max_decrease "
                           f"(found {', '.join(present)})")  # fmt: skip
    most = MAX_RELATIVE if data["kind"] == "relative" else MAX_VALUE
    amounts = {
        k: _json_number(f"metrics.{metric}.limit.{k}", data[k], minimum=0.0, maximum=most, source=str(path))
        for k in present
    }
    return Limit(kind=data["kind"], **amounts)


@dataclasses.dataclass(frozen=True)
class Guard:
    """A bound on ``metric`` at ``step`` that needs no baseline value (``minimum`` / ``maximum``: None = none)."""

    metric: str
    step: int
    minimum: float | None = None
    maximum: float | None = None
    why: str | None = None

    def holds(self, value: float) -> bool:
        return (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)

    def describe(self) -> str:
        bounds = [f">= {self.minimum:g}" if self.minimum is not None else "",
                  f"<= {self.maximum:g}" if self.maximum is not None else ""]  # fmt: skip
        return " and ".join(b for b in bounds if b) + f" at step {self.step}"

    @property
    def bound(self) -> float:
        """The bound a value is compared with (the lower one when both are set)."""
        return self.minimum if self.minimum is not None else self.maximum  # type: ignore[return-value]


def _guard(path: Path, metric: str, data: Any) -> Guard:
    source, where = str(path), f"{path}: guards.{metric}"
    if not isinstance(data, dict) or "step" not in data or not ({"min", "max"} & set(data)):
        raise CompareError(f"{where}: needs step (an integer) and min and/or max (numbers)")
    unknown = set(data) - set(GUARD_KEYS)
    if unknown:
        raise CompareError(f"{where}: unknown keys {sorted(unknown)[:10]} (allowed: {', '.join(GUARD_KEYS)})")
    step = _json_integer(f"guards.{metric}.step", data["step"], minimum=0, maximum=MAX_STEP, source=source)
    bounds = {
        k: _json_number(f"guards.{metric}.{k}", data[k], minimum=-MAX_VALUE, maximum=MAX_VALUE, source=source)
        if k in data
        else None
        for k in ("min", "max")
    }
    if bounds["min"] is not None and bounds["max"] is not None and bounds["min"] > bounds["max"]:
        raise CompareError(f"{where}: min {bounds['min']:g} is above max {bounds['max']:g}")
    why = None if data.get("why") is None else label(f"guards.{metric}.why", data["why"], max_length=MAX_TEXT,
                                                      source=source)  # fmt: skip
    return Guard(metric, step, bounds["min"], bounds["max"], why)


@dataclasses.dataclass(frozen=True)
class Baseline:
    path: Path
    job: str
    window: tuple[int, int]
    values: dict[str, float | None]
    limits: dict[str, Limit]
    image: str | None
    commit: str | None
    guards: tuple[Guard, ...] = ()


def _baseline_json(path: Path) -> Any:
    if not path.exists():
        raise CompareError(f"{path}: no such baseline file")
    try:
        data_bytes = read_bytes(path, MAX_BASELINE_BYTES)
    except NotReadable as exc:
        raise CompareError(f"{path}: cannot read the baseline ({exc})") from None
    try:
        text = data_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CompareError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        return loads_json(text)
    except DuplicateKey as exc:
        raise CompareError(f"{path}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more than 4300 digits
        raise CompareError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CompareError(f"{path}: not valid JSON (nested too deeply)") from None


def read_baseline(path: str | Path) -> Baseline:
    """The baseline at ``path``, every field parsed and range-checked; CompareError names the file and field."""
    path = Path(path)
    data = _baseline_json(path)
    try:
        return parse_baseline(path, data)
    except InputError as exc:
        raise CompareError(str(exc)) from None


def _known_keys(where: str, data: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        shown = [u[:80] for u in unknown[:10]]
        raise CompareError(f"{where}: unknown keys {shown} (allowed: {', '.join(allowed)}; the gate reads no other, "
                           "so a misspelt key would be ignored)")  # fmt: skip


def _header(path: Path, data: dict) -> tuple[str, str | None, str | None]:
    """(job, image, commit), and every other top-level text checked: a known format, one-line text, a date."""
    source = str(path)
    version = data.get("format", BASELINE_FORMAT)  # first: another format may have other keys
    if type(version) is not int or version != BASELINE_FORMAT:
        raise CompareError(f"{path}: format={version!r}: this verl-npu reads baseline format {BASELINE_FORMAT} "
                           "(a baseline without format is format 1)")  # fmt: skip
    _known_keys(str(path), data, BASELINE_KEYS)
    job = label("job", data["job"], source=source)
    if data.get("description") is not None:
        label("description", data["description"], max_length=MAX_TEXT, source=source)
    if data.get("source_log") is not None:
        label("source_log", data["source_log"], max_length=255, source=source)
    taken = data.get("taken")
    if taken is not None and not (isinstance(taken, str) and _DATE.fullmatch(taken) and _is_date(taken)):
        raise InputError("taken", taken, "null or a date YYYY-MM-DD", source=source)
    return job, image_reference("image", data.get("image"), source), commit_name("commit", data.get("commit"), source)


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def image_reference(key: str, value: Any, source: str | None = None) -> str | None:
    """None, or an image reference a registry and a shell read as written (the OCI distribution grammar)."""
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) <= MAX_IMAGE and IMAGE_REFERENCE.fullmatch(value)):
        raise InputError(key, value, "an image reference [REGISTRY/]NAME[:TAG][@DIGEST] (lowercase name, no "
                         f"spaces or control characters, at most {MAX_IMAGE} characters)", source=source)  # fmt: skip
    return value


def commit_name(key: str, value: Any, source: str | None = None) -> str | None:
    if value is None:
        return None
    if not (isinstance(value, str) and COMMIT.fullmatch(value)):
        raise InputError(key, value, "a git commit (as `git rev-parse HEAD` prints it) or revision: letters, "
                         "digits and . _ / - only, at most 200 characters", source=source)  # fmt: skip
    return value


def parse_baseline(path: Path, data: Any) -> Baseline:
    """A baseline from its parsed JSON (raises CompareError or InputError naming ``path`` and the field)."""
    source = str(path)
    if not isinstance(data, dict):
        raise CompareError(f"{path}: a baseline is a JSON object with job, window and metrics")
    for key in ("job", "window", "metrics"):
        if key not in data:
            raise CompareError(f"{path}: missing top-level key {key!r}")
    job, image, commit = _header(path, data)
    window = data["window"]
    if not isinstance(window, dict) or "first_step" not in window or "last_step" not in window:
        raise CompareError(f"{path}: window must be {{'first_step': N, 'last_step': M}}")
    _known_keys(f"{path}: window", window, WINDOW_KEYS)
    first = _json_integer("window.first_step", window["first_step"], minimum=1, maximum=MAX_STEP, source=source)
    last = _json_integer("window.last_step", window["last_step"], minimum=first,
                          maximum=min(MAX_STEP, first + MAX_WINDOW - 1), source=source)  # fmt: skip
    metrics = data["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise CompareError(f"{path}: metrics must be a non-empty mapping of metric name -> {{value, limit}}")
    if len(metrics) > MAX_METRICS:
        raise CompareError(f"{path}: metrics has {len(metrics)} entries (at most {MAX_METRICS})")
    values, limits = {}, {}
    for metric, entry in metrics.items():
        label("metrics (a metric name)", metric, source=source)
        if not isinstance(entry, dict) or "limit" not in entry or "value" not in entry:
            raise CompareError(f"{path}: metrics.{metric} needs 'value' (null until taken) and 'limit'")
        _known_keys(f"{path}: metrics.{metric}", entry, METRIC_KEYS)
        value = entry["value"]
        if value is not None:
            value = _json_number(f"metrics.{metric}.value", value, minimum=-MAX_VALUE, maximum=MAX_VALUE,
                                 source=source)  # fmt: skip
        values[metric] = value
        limits[metric] = _limit(path, metric, entry["limit"])
    guards = data.get("guards", {})
    if not isinstance(guards, dict) or len(guards) > MAX_METRICS:
        raise CompareError(f"{path}: guards must map at most {MAX_METRICS} metric names to {{step, min and/or max}}")
    for metric in guards:
        label("guards (a metric name)", metric, source=source)
    parsed = tuple(_guard(path, metric, entry) for metric, entry in guards.items())
    return Baseline(path, job, (first, last), values, limits, image, commit, parsed)


# --- comparing -----------------------------------------------------------------------------------
VERDICTS = {OK: "ok", FAIL: "regression"}  # the shared check status -> the word in the JSON report


@dataclasses.dataclass(frozen=True)
class Row:
    metric: str
    baseline: float
    current: float
    delta: float
    limit: str
    verdict: str  # "ok" or "regression"

    @property
    def status(self) -> str:
        """The verdict in the shared check vocabulary (verl_npu.checks): a regression fails."""
        return OK if self.verdict == VERDICTS[OK] else FAIL

    def to_check(self) -> Check:
        detail = (
            f"window mean {self.current:.6g} vs baseline {self.baseline:.6g} ({self.delta:+.6g}; limit {self.limit})"
        )
        return Check(f"metric.{self.metric}", self.status, detail)


COLUMNS = (
    Column("metric", lambda r: r.metric),
    Column("baseline", lambda r: f"{r.baseline:.6g}", justify="right"),
    Column("current", lambda r: f"{r.current:.6g}", justify="right"),
    Column("delta", lambda r: f"{r.delta:+.6g}", justify="right"),
    Column("limit", lambda r: r.limit),
    Column("verdict", lambda r: status_markup(r.status, None if r.status == OK else "REGRESSION"), markup=True),
)


def table(rows: list[Row], title: str):
    """The comparison as the shared check table, one row per metric (``verl-npu ci compare`` prints it).

    Metric names and the title come from files: they are shown as text, never read as rich markup.
    """
    from rich.markup import escape

    return checks_table(rows, escape(title), COLUMNS, escape=True)


def guard_rows(steps: dict[int, dict[str, float]], guards: tuple[Guard, ...], log: str) -> list[Row]:
    """One row per guard: its metric at its step against its bound (CompareError when it was not measured there)."""
    rows = []
    for guard in guards:
        value = steps.get(guard.step, {}).get(guard.metric)
        if value is None:
            have = "no such step" if guard.step not in steps else "the metric is not logged there"
            raise CompareError(
                f"{log}: guard {guard.metric!r} needs its value at step {guard.step} ({have}; verl logs the "
                "rollout-vs-actor metrics only with actor_rollout_ref.rollout.calculate_log_probs=True)"
            )
        if not math.isfinite(value):
            raise CompareError(
                f"{log}: guard {guard.metric!r} is {value} at step {guard.step} (a gate does not pass on a value "
                "that is not a number; verl writes nan when no response token was valid)"
            )
        verdict = VERDICTS[OK if guard.holds(value) else FAIL]
        rows.append(Row(f"{guard.metric} (step {guard.step})", guard.bound, value, value - guard.bound,
                        guard.describe(), verdict))  # fmt: skip
    return rows


def compare(log: str | Path, baseline: Baseline) -> list[Row]:
    """Guards first (they need no baseline value), then each metric's window mean against its baseline value."""
    pending = [m for m, v in baseline.values.items() if v is None]
    steps = read_log(log) if baseline.guards or not pending else {}
    rows = guard_rows(steps, baseline.guards, str(log))
    if pending:
        if any(r.verdict != VERDICTS[OK] for r in rows):
            return rows  # a failed guard is a regression whether or not the baseline's values are taken
        passed = f" (its guards passed: {', '.join(r.metric for r in rows)})" if rows else ""
        raise CompareError(
            f"{baseline.path}: no values taken yet for {pending}{passed}; take them from a good run with "
            f"`verl-npu ci compare LOG {baseline.path} --update`"
        )
    for metric, reference in baseline.values.items():
        current = window_average(steps, metric, baseline.window, str(log))
        low, high = baseline.limits[metric].bounds(reference)
        bad = (low is not None and current < low) or (high is not None and current > high)
        rows.append(
            Row(metric, reference, current, current - reference, baseline.limits[metric].describe(),
                VERDICTS[FAIL if bad else OK])
        )  # fmt: skip
    return rows


def update_baseline(log: str | Path, baseline_path: str | Path, *, image: str | None, commit: str | None) -> dict:
    """Take every metric's windowed average from ``log`` into the baseline (limits and window are kept).

    Refuses a value the baseline could not hold (not finite, out of range) and text a shell would read otherwise
    (``image``, ``commit``, the log's name), before reading the log; writes the file whole or not at all.
    """
    path = Path(baseline_path)
    try:
        image, commit = image_reference("--image", image), commit_name("--commit", commit)
        source_log = label("the log's file name (source_log)", Path(log).name, max_length=255)
    except InputError as exc:
        raise CompareError(f"{exc} (nothing written to {path})") from None
    why = atomic.output_problem(path)
    if why is not None:
        raise CompareError(f"{path}: cannot write the baseline: {why}")
    if path.exists():
        data = _baseline_json(path)
        try:
            current = parse_baseline(path, data)
        except InputError as exc:
            raise CompareError(str(exc)) from None
        window, metrics = current.window, list(current.values)
    else:
        data = {"format": BASELINE_FORMAT, "job": path.stem, "metrics": {}, "guards": DEFAULT_GUARDS}
        window, metrics = DEFAULT_WINDOW, list(DEFAULT_LIMITS)
    steps = read_log(log)
    data["window"] = {"first_step": window[0], "last_step": window[1]}
    for metric in metrics:
        entry = data["metrics"].setdefault(metric, {})
        if "limit" not in entry:
            kind, key, amount = DEFAULT_LIMITS[metric]
            entry["limit"] = {"kind": kind, key: amount}
        mean = round(window_average(steps, metric, window, str(log)), 6)
        entry["value"] = inputs.number(f"metrics.{metric}.value", mean, minimum=-MAX_VALUE, maximum=MAX_VALUE,
                                       source=f"{log} (its window mean, not written to {path})")  # fmt: skip
    data.setdefault("format", BASELINE_FORMAT)
    data.update(image=image, commit=commit, taken=datetime.date.today().isoformat(), source_log=source_log)
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"  # every field was range-checked: never NaN here
    try:
        parse_baseline(path, loads_json(text))  # what is written reads back as a baseline, or nothing is written
    except InputError as exc:
        raise CompareError(f"{exc} (refusing to write {path})") from None
    try:
        atomic.write_text(path, text)
    except OSError as exc:
        why = exc.strerror or exc
        raise CompareError(f"{path}: cannot write the baseline ({why}); the old file is intact") from None
    return data
