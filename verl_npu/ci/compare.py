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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from pathlib import Path
from typing import Any

from verl_npu.checks import FAIL, OK, Check, Column, status_markup
from verl_npu.checks import table as checks_table
from verl_npu.errors import UserError

_CONSOLE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")
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


class CompareError(UserError):
    """A log or baseline that cannot be compared (names the file, line or metric and the fix)."""


# --- reading the log -----------------------------------------------------------------------------
def _number(text: str) -> float:
    text = text.strip()
    match = _NUMPY_SCALAR.match(text)
    if match:
        text = match.group(1)
    if text in ("True", "False"):
        return float(text == "True")
    return float(text)


def _console_line(path: Path, number: int, line: str, last: bool) -> tuple[int, dict[str, float]] | None:
    match = _CONSOLE.search(line)
    if not match:
        return None
    step, metrics = int(match.group(1)), {}
    for item in match.group(2).split(" - "):
        key, sep, value = item.rpartition(":")
        try:
            if not sep or not key:
                raise ValueError(item)
            metrics[key.strip()] = _number(value)
        except ValueError:
            what = "truncated (the last line ends mid-record)" if last else "malformed"
            raise CompareError(f"{path}:{number}: {what}: cannot read {item!r} as key:value") from None
    return step, metrics


def read_log(path: str | Path) -> dict[int, dict[str, float]]:
    """Metrics per step from a verl console log or file-logger JSONL (the format is detected per line)."""
    path = Path(path)
    if not path.is_file():
        raise CompareError(f"{path}: no such log file")
    lines = path.read_text(errors="replace").splitlines()
    steps: dict[int, dict[str, float]] = {}
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                what = "truncated (the last line ends mid-record)" if last else "malformed JSON"
                raise CompareError(f"{path}:{number}: {what}") from None
            if not isinstance(record, dict) or "step" not in record or not isinstance(record.get("data"), dict):
                raise CompareError(f'{path}:{number}: a JSON line must be {{"step": N, "data": {{...}}}}')
            entry = (int(record["step"]), {k: float(v) for k, v in record["data"].items() if _is_number(v)})
        else:
            entry = _console_line(path, number, line, last)
            if entry is None:
                continue
        step, metrics = entry
        steps.setdefault(step, {}).update(metrics)
    if not steps:
        raise CompareError(
            f"{path}: no per-step metric lines (expected verl's console 'step:N - key:value' lines or its file "
            "logger's JSON lines); was the job run with trainer.logger containing 'console' or 'file'?"
        )
    return steps


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
    values = [steps[s][metric] for s in wanted if metric in steps[s]]
    if len(values) < len(wanted):
        lacking = [s for s in wanted if metric not in steps[s]]
        raise CompareError(f"{log}: metric {metric!r} is missing at steps {lacking} of the window {first}-{last}")
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        raise CompareError(f"{log}: metric {metric!r} is nan/inf at some steps of the window {first}-{last}")
    return sum(finite) / len(finite)


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


def _limit(path: Path, metric: str, data: Any) -> Limit:
    where = f"{path}: metrics.{metric}.limit"
    if not isinstance(data, dict) or data.get("kind") not in LIMIT_KINDS:
        raise CompareError(f"{where}: needs kind = {' or '.join(LIMIT_KINDS)}")
    unknown = set(data) - {"kind", *LIMIT_KEYS}
    if unknown:
        raise CompareError(f"{where}: unknown keys {sorted(unknown)} (allowed: kind, {', '.join(LIMIT_KEYS)})")
    amounts = {k: data[k] for k in LIMIT_KEYS if k in data}
    if not amounts or any(not _is_number(v) or v < 0 for v in amounts.values()):
        raise CompareError(f"{where}: give one or more of {', '.join(LIMIT_KEYS)} as non-negative numbers")
    return Limit(kind=data["kind"], **{k: float(v) for k, v in amounts.items()})


@dataclasses.dataclass(frozen=True)
class Baseline:
    path: Path
    job: str
    window: tuple[int, int]
    values: dict[str, float | None]
    limits: dict[str, Limit]
    image: str | None
    commit: str | None


def read_baseline(path: str | Path) -> Baseline:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CompareError(f"{path}: no such baseline file") from None
    except json.JSONDecodeError as exc:
        raise CompareError(f"{path}: not valid JSON ({exc})") from None
    for key in ("job", "window", "metrics"):
        if key not in data:
            raise CompareError(f"{path}: missing top-level key {key!r}")
    window = data["window"]
    if not (isinstance(window, dict) and _is_number(window.get("first_step")) and _is_number(window.get("last_step"))):
        raise CompareError(f"{path}: window must be {{'first_step': N, 'last_step': M}}")
    first, last = int(window["first_step"]), int(window["last_step"])
    if not 0 < first <= last:
        raise CompareError(f"{path}: window first_step {first} .. last_step {last} is empty")
    values, limits = {}, {}
    if not isinstance(data["metrics"], dict) or not data["metrics"]:
        raise CompareError(f"{path}: metrics must be a non-empty mapping of metric name -> {{value, limit}}")
    for metric, entry in data["metrics"].items():
        if not isinstance(entry, dict) or "limit" not in entry or "value" not in entry:
            raise CompareError(f"{path}: metrics.{metric} needs 'value' (null until taken) and 'limit'")
        value = entry["value"]
        if value is not None and not _is_number(value):
            raise CompareError(f"{path}: metrics.{metric}.value must be a number or null, found {value!r}")
        values[metric] = None if value is None else float(value)
        limits[metric] = _limit(path, metric, entry["limit"])
    return Baseline(path, str(data["job"]), (first, last), values, limits, data.get("image"), data.get("commit"))


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
    """The comparison as the shared check table, one row per metric (``verl-npu ci compare`` prints it)."""
    return checks_table(rows, title, COLUMNS)


def compare(log: str | Path, baseline: Baseline) -> list[Row]:
    pending = [m for m, v in baseline.values.items() if v is None]
    if pending:
        raise CompareError(
            f"{baseline.path}: no values taken yet for {pending}; take them from a good run with "
            f"`verl-npu ci compare LOG {baseline.path} --update`"
        )
    steps = read_log(log)
    rows = []
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
    """Take every metric's windowed average from ``log`` into the baseline (limits and window are kept)."""
    path = Path(baseline_path)
    if path.is_file():
        current = read_baseline(path)
        data = json.loads(path.read_text())
        window, metrics = current.window, list(current.values)
    else:
        data = {"job": path.stem, "metrics": {}}
        window, metrics = DEFAULT_WINDOW, list(DEFAULT_LIMITS)
    steps = read_log(log)
    data["window"] = {"first_step": window[0], "last_step": window[1]}
    for metric in metrics:
        entry = data["metrics"].setdefault(metric, {})
        if "limit" not in entry:
            kind, key, amount = DEFAULT_LIMITS[metric]
            entry["limit"] = {"kind": kind, key: amount}
        entry["value"] = round(window_average(steps, metric, window, str(log)), 6)
    data.update(image=image, commit=commit, taken=datetime.date.today().isoformat(), source_log=Path(log).name)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data
