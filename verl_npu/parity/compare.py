"""``verl-npu parity compare`` and ``parity reference``: a run against the CUDA reference, or two runs against
each other, with tolerances measured on the reference device.

What is compared, per model: per-token log-probs of the evaluation batch (mean and max of the absolute
differences) and after training; each training step's loss and gradient norm; each DSA layer's top-k (the
overlap of the selected key sets, per stored query row); and the activation checksums in forward order
(verl_npu.parity.probes), where the first point out of tolerance localises the fault. Anything missing, malformed
or not finite fails: a comparison never passes on what it could not compare. The one exception is said as a
warning: a run whose indexer ran inside a fused kernel has no indexer q/k checksums (``indexer_qk: false``).

How the tolerances are derived (:func:`derive`; ``verl-npu parity reference``). A legitimate implementation X
(another platform, another kernel) and the reference R both approximate the exact result T; their difference
is at most the sum of their errors, |X - R| <= |X - T| + |R - T|. With X no less accurate than R, that is at most
twice R's own error. R's error is measured on the reference device against the same job in a precision with a
smaller unit roundoff: bf16 against fp32, fp32 against fp64. Run-to-run (the same job again, another process) is
measured too and the larger of the two spreads counts. So, per compared value:

- tolerance = max(2 x spread, the unit roundoff of the run's dtype x the value's own magnitude): the second term
  is the rounding of the result itself, which two implementations do independently (for a checksum, its RMS);
- a top-k's minimum overlap = 1 - 2 x (1 - the measured overlap), by the same bound on the keys that differ.

Modes: ``reference`` (a run against the reference's run of its dtype, with the reference's tolerances for that
dtype); ``pair`` (two runs against each other, with the same tolerances; on Ascend the fused and the portable run,
so a failure points at an operator); ``exact`` (two runs of one build on one machine: any difference fails, as
deterministic mode makes them bitwise equal).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.errors import UserError
from verl_npu.parity.job import DTYPES, FORMAT
from verl_npu.parity.probes import STATISTICS

REFERENCE_KIND = "verl-npu parity reference"
MAX_FILE_BYTES = 256 * MIB
TRIANGLE = 2.0  # |X - R| <= |X - T| + |R - T| <= 2 |R - T| (module docstring)
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp32": 2.0**-24, "fp64": 2.0**-53}
PRECISE = {"bf16": "fp32", "fp32": "fp64"}  # the precision each dtype's error is measured against
MODES = ("reference", "pair", "exact")


class ParityCompareError(UserError):
    """A run or reference file that cannot be compared: unreadable, malformed, or of another kind."""


# --- reading what comes from outside -------------------------------------------------------------------------------
def _finite(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParityCompareError(f"{where}={value!r}: expected a finite number")
    return float(value)


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ParityCompareError(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


def _list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ParityCompareError(f"{where}: expected a JSON list, found {type(value).__name__}")
    return value


def load(path: str | Path, kind: str) -> dict[str, Any]:
    """A parity run or reference file (``kind``), read bounded and checked for its kind and format."""
    path = Path(path)
    try:
        data = json.loads(read_bytes(path, MAX_FILE_BYTES).decode("utf-8"))
    except NotReadable as exc:
        raise ParityCompareError(f"{path}: cannot read it ({exc})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ParityCompareError(f"{path}: not a JSON file ({exc})") from None
    data = dict(_mapping(str(path), data))
    if data.get("kind") != kind:
        raise ParityCompareError(f"{path}: kind={data.get('kind')!r}: expected {kind!r}")
    if data.get("format") != FORMAT:
        raise ParityCompareError(f"{path}: format={data.get('format')!r}: this verl-npu reads format {FORMAT}")
    data["_path"] = str(path)
    return data


def run_dtype(run: Mapping[str, Any]) -> str:
    dtype = run.get("dtype")
    if dtype not in DTYPES:
        raise ParityCompareError(f"{run.get('_path', 'run')}: dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


# --- the values of a run ------------------------------------------------------------------------------------------
def _logprobs(where: str, value: Any) -> list[list[float]]:
    rows = _list(where, value)
    return [
        [_finite(f"{where}[{i}][{j}]", x) for j, x in enumerate(_list(f"{where}[{i}]", row))]
        for i, row in enumerate(rows)
    ]


def _series(where: str, value: Any) -> list[float]:
    return [_finite(f"{where}[{i}]", x) for i, x in enumerate(_list(where, value))]


def _checksums(where: str, value: Any) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, record in enumerate(_list(where, value)):
        record = _mapping(f"{where}[{i}]", record)
        point = record.get("point")
        if not isinstance(point, str):
            raise ParityCompareError(f"{where}[{i}].point={point!r}: expected a point name")
        out[point] = {stat: _finite(f"{where}[{i}].{stat}", record.get(stat)) for stat in STATISTICS}
    return out


def _topk(where: str, value: Any) -> dict[str, dict[tuple[int, int], frozenset[int]]]:
    from verl_npu.parity.probes import topk_sets

    out = {}
    for layer, record in _mapping(where, value).items():
        try:
            out[layer] = topk_sets(_mapping(f"{where}.{layer}", record))
        except ParityCompareError:
            raise
        except Exception as exc:  # base64, lengths and rows that do not fit together: malformed, named
            raise ParityCompareError(f"{where}.{layer}: malformed top-k record ({type(exc).__name__}: {exc})") from None
    return out


@dataclasses.dataclass(frozen=True)
class ModelValues:
    logprobs: list[list[float]]
    after_logprobs: list[list[float]]
    losses: list[float]
    grad_norms: list[float]
    checksums: dict[str, dict[str, float]]  # point -> statistic (mean, rms, proj) -> value, in forward order
    topk: dict[str, dict[tuple[int, int], frozenset[int]]]
    indexer_qk: bool


def model_values(run: Mapping[str, Any], model: str) -> ModelValues:
    where = f"{run.get('_path', 'run')}: models.{model}"
    m = _mapping(
        where,
        _mapping(f"{where}", run.get("models", {})).get(model) if isinstance(run.get("models"), Mapping) else None,
    )
    evaluation = _mapping(f"{where}.eval", m.get("eval"))
    train = _mapping(f"{where}.train", m.get("train"))
    after = _mapping(f"{where}.after_training", m.get("after_training"))
    return ModelValues(
        logprobs=_logprobs(f"{where}.eval.logprobs", evaluation.get("logprobs")),
        after_logprobs=_logprobs(f"{where}.after_training.logprobs", after.get("logprobs")),
        losses=_series(f"{where}.train.losses", train.get("losses")),
        grad_norms=_series(f"{where}.train.grad_norms", train.get("grad_norms")),
        checksums=_checksums(f"{where}.eval.checksums", evaluation.get("checksums")),
        topk=_topk(f"{where}.eval.topk", evaluation.get("topk", {})),
        indexer_qk=evaluation.get("indexer_qk") is True,
    )


def models_of(run: Mapping[str, Any]) -> list[str]:
    return sorted(_mapping(f"{run.get('_path', 'run')}: models", run.get("models")))


# --- differences ----------------------------------------------------------------------------------------------------
def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def _same_shape(where: str, a: list[list[float]], b: list[list[float]]) -> None:
    if [len(r) for r in a] != [len(r) for r in b]:
        raise ValueError(f"{where}: shapes differ ({[len(r) for r in a]} vs {[len(r) for r in b]})")


def overlap(a: Mapping[tuple[int, int], frozenset[int]], b: Mapping[tuple[int, int], frozenset[int]]) -> float:
    """Mean over the query rows of |A & B| / max(|A|, |B|): 1.0 when every row selects the same keys."""
    if set(a) != set(b):
        raise ValueError("the runs stored different query rows")
    if not a:
        return 1.0
    return sum(len(a[r] & b[r]) / max(len(a[r]), len(b[r]), 1) for r in a) / len(a)


@dataclasses.dataclass(frozen=True)
class Spread:
    """The differences between two runs of one model: what the tolerances are derived from, and what is judged."""

    logprob_mean: float
    logprob_max: float
    after_logprob_mean: float
    after_logprob_max: float
    losses: list[float]  # per step, absolute
    grad_norms: list[float]  # per step, relative to the second run's
    checksums: dict[str, dict[str, float]]  # point -> statistic -> |difference|, points of the second run
    missing_points: list[str]  # points of the second run the first has not
    extra_points: list[str]  # points of the first run the second has not (a module that ran twice, another build)
    topk_overlap: dict[str, float]  # layer -> overlap
    missing_topk: list[str]


def spread(a: ModelValues, b: ModelValues) -> Spread:
    """How ``a`` differs from ``b`` (``b`` is the reference side). Raises ValueError for shapes that differ."""
    _same_shape("eval log-probs", a.logprobs, b.logprobs)
    _same_shape("log-probs after training", a.after_logprobs, b.after_logprobs)
    if len(a.losses) != len(b.losses) or len(a.grad_norms) != len(b.grad_norms):
        raise ValueError(f"training steps differ ({len(a.losses)} vs {len(b.losses)})")
    d = [abs(x - y) for x, y in zip(_flat(a.logprobs), _flat(b.logprobs), strict=True)]
    d_after = [abs(x - y) for x, y in zip(_flat(a.after_logprobs), _flat(b.after_logprobs), strict=True)]
    checks = {
        p: {stat: abs(a.checksums[p][stat] - value) for stat, value in stats.items()}
        for p, stats in b.checksums.items()
        if p in a.checksums
    }
    return Spread(
        logprob_mean=sum(d) / max(len(d), 1),
        logprob_max=max(d, default=0.0),
        after_logprob_mean=sum(d_after) / max(len(d_after), 1),
        after_logprob_max=max(d_after, default=0.0),
        losses=[abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)],
        grad_norms=[abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a.grad_norms, b.grad_norms, strict=True)],
        checksums=checks,
        missing_points=[p for p in b.checksums if p not in a.checksums],
        extra_points=[p for p in a.checksums if p not in b.checksums],
        topk_overlap={layer: overlap(a.topk[layer], sets) for layer, sets in b.topk.items() if layer in a.topk},
        missing_topk=[layer for layer in b.topk if layer not in a.topk],
    )


# --- tolerances -----------------------------------------------------------------------------------------------------
def errors(primary: Mapping[str, Any], precise: Mapping[str, Any], repeat: Mapping[str, Any] | None = None):
    """Per model, ``primary``'s measured error: its spread against ``precise`` (the same job in the next wider
    dtype, standing in for the exact values) and against ``repeat`` (the same job again), the larger of the two."""
    out: dict[str, Any] = {}
    for model in models_of(primary):
        ref = model_values(primary, model)
        spreads = [spread(model_values(precise, model), ref)]
        if repeat is not None:
            spreads.append(spread(model_values(repeat, model), ref))

        def worst(name: str, spreads: list[Spread] = spreads) -> float:
            return max(getattr(s, name) for s in spreads)

        out[model] = {
            "logprob_mean": worst("logprob_mean"),
            "logprob_max": worst("logprob_max"),
            "after_logprob_mean": worst("after_logprob_mean"),
            "after_logprob_max": worst("after_logprob_max"),
            "losses": [max(s.losses[i] for s in spreads) for i in range(len(ref.losses))],
            "grad_norms": [max(s.grad_norms[i] for s in spreads) for i in range(len(ref.grad_norms))],
            "checksums": _depth_relative_spreads(ref, spreads),  # relative to each point's RMS
            "topk_disagreement": {
                layer: 1.0 - min((s.topk_overlap.get(layer, 1.0) for s in spreads), default=1.0) for layer in ref.topk
            },
        }
    return out


def tolerances(
    run: Mapping[str, Any], reference_errors: Mapping[str, Any], candidate_errors: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Per model, the tolerances for comparing a run with ``run`` (the reference's run of that dtype).

    |X - R| <= |X - T| + |R - T|: the reference's measured error plus the candidate's (``candidate_errors``, measured
    the same way on its own platform) when it is given, else the reference's twice (the candidate assumed no less
    accurate); never below the rounding of the result itself (the unit roundoff of the dtype x its magnitude).
    """
    u = UNIT_ROUNDOFF[run_dtype(run)]
    out: dict[str, Any] = {}
    for model, ref_err in reference_errors.items():
        if model not in models_of(run):
            continue
        cand = (candidate_errors or {}).get(model, ref_err)
        values = model_values(run, model)
        logprob_scale = max((abs(x) for x in _flat(values.logprobs)), default=1.0)
        after_scale = max((abs(x) for x in _flat(values.after_logprobs)), default=1.0)

        def both(key: str, floor: float, ref_err: Mapping[str, Any] = ref_err, cand: Mapping[str, Any] = cand) -> float:
            return max(_finite(f"errors.{key}", ref_err[key]) + _finite(f"errors.{key}", cand[key]), floor)

        steps = range(len(values.losses))
        checksums = {}
        for point, stats in values.checksums.items():
            relative = _finite(f"errors.checksums.{point}", ref_err["checksums"].get(point, 0.0))
            relative += _finite(f"errors.checksums.{point}", cand["checksums"].get(point, relative))
            checksums[point] = dict.fromkeys(STATISTICS, max(relative * stats["rms"], u * stats["rms"]))
        out[model] = {
            "logprob_mean": both("logprob_mean", u * logprob_scale),
            "logprob_max": both("logprob_max", u * logprob_scale),
            "after_logprob_mean": both("after_logprob_mean", u * after_scale),
            "after_logprob_max": both("after_logprob_max", u * after_scale),
            "losses": [max(ref_err["losses"][i] + cand["losses"][i], u * abs(values.losses[i])) for i in steps],
            "grad_norms": [max(ref_err["grad_norms"][i] + cand["grad_norms"][i], u) for i in steps],
            "checksums": checksums,
            "topk_min_overlap": {
                layer: max(0.0, 1.0 - d - cand["topk_disagreement"].get(layer, d))
                for layer, d in ref_err["topk_disagreement"].items()
            },
        }
    return out


def derive(primary: Mapping[str, Any], precise: Mapping[str, Any], repeat: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tolerances of ``primary``'s dtype with the candidate assumed no less accurate (twice the reference's
    measured error, module docstring)."""
    return tolerances(primary, errors(primary, precise, repeat))


def depth(point: str) -> tuple[int, int]:
    """Where a checksum point sits in the forward pass: (-1, 0) the embedding, (N, 0) layer N, (10**6, 0) after
    the last layer (final norm, logits); the micro-batch does not count (each is a forward of its own)."""
    name = point.partition("/")[2].partition("#")[0]
    if name.startswith("layers."):
        return int(name.split(".")[1]), 0
    return (-1, 0) if name == "embedding" else (10**6, 0)


def _depth_relative_spreads(ref: ModelValues, spreads: Sequence[Spread]) -> dict[str, float]:
    """Per point, the largest relative spread (|d| / the point's RMS) measured at its depth or shallower.

    One measured difference at one point is one sample of a rounding error; another implementation's can be larger
    there while the reference's happened to be small. Rounding errors grow with depth, so the error a legitimate
    implementation may make at a depth is bounded by the largest the reference made at that depth or before it.
    """
    at_depth: dict[tuple[int, int], float] = {}
    for point, stats in ref.checksums.items():
        scale = stats["rms"] or 1.0
        worst = max((max(s.checksums[point].values()) for s in spreads if point in s.checksums), default=0.0)
        key = depth(point)
        at_depth[key] = max(at_depth.get(key, 0.0), worst / scale)
    running, cumulative = 0.0, {}
    for key in sorted(at_depth):
        running = max(running, at_depth[key])
        cumulative[key] = running
    return {point: cumulative[depth(point)] for point in ref.checksums}


DERIVATION = (
    "tolerance = max(2 x the largest measured spread, the unit roundoff of the dtype x the value's magnitude); "
    "spread of a bf16 value: against the same job in fp32 and against a second bf16 run; of an fp32 value: "
    "against fp64 and a second fp32 run; all on the reference device. For an activation checksum the spread is "
    "relative to the tensor's RMS and the largest at its layer or any layer before it (rounding errors grow with "
    "depth; one point's measured error is one sample). A top-k's minimum overlap = "
    "1 - 2 x (1 - its measured overlap). Why 2: |X - R| <= |X - T| + |R - T| for any implementation X no less "
    "accurate than the reference R (T: the exact value). Why the roundoff term: two implementations round the "
    "result itself independently (for a checksum, by up to one unit roundoff of its RMS)."
)


def reference(runs: Mapping[str, Mapping[str, Any]], repeats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The reference file: the bf16 and fp32 runs, their tolerances and how they were derived.

    ``runs``: dtype -> run for bf16, fp32 and fp64 (fp64 only measures fp32's error); ``repeats``: dtype -> a second
    run of bf16 and fp32 (run-to-run).
    """
    missing = [d for d in ("bf16", "fp32", "fp64") if d not in runs] + [d for d in ("bf16", "fp32") if d not in repeats]
    if missing:
        raise ParityCompareError(f"a reference needs runs in bf16, fp32 and fp64 and repeats in bf16 and fp32; "
                                 f"missing {', '.join(missing)}")  # fmt: skip
    for dtype, run in [*runs.items(), *repeats.items()]:
        if run_dtype(run) != dtype:
            raise ParityCompareError(f"{run.get('_path', 'run')}: dtype {run_dtype(run)}, given as the {dtype} run")
    devices = {r.get("device") for r in [*runs.values(), *repeats.values()]}
    if len(devices) != 1:
        raise ParityCompareError(f"the runs come from different devices ({', '.join(map(str, devices))})")
    measured, limits, spreads = {}, {}, {}
    for dtype in ("bf16", "fp32"):
        precise = PRECISE[dtype]
        measured[dtype] = errors(runs[dtype], runs[precise], repeats[dtype])
        limits[dtype] = tolerances(runs[dtype], measured[dtype])
        spreads[dtype] = {}
        for model in models_of(runs[dtype]):
            ref = model_values(runs[dtype], model)
            spreads[dtype][model] = {
                precise: _summary(spread(model_values(runs[precise], model), ref)),
                "repeat": _summary(spread(model_values(repeats[dtype], model), ref)),
            }
    strip = lambda run: {k: v for k, v in run.items() if not k.startswith("_")}  # noqa: E731
    return {
        "kind": REFERENCE_KIND,
        "format": FORMAT,
        "device": next(iter(devices)),
        "versions": runs["bf16"].get("versions"),
        "derivation": DERIVATION,
        "runs": {dtype: strip(runs[dtype]) for dtype in ("bf16", "fp32", "fp64")},  # fp64: for --precise fp64
        "errors": measured,  # the reference's measured error per dtype and model (compare adds a candidate's)
        "tolerances": limits,  # with the candidate assumed no less accurate: twice the reference's error
        "measured_spreads": spreads,
    }


def _summary(s: Spread) -> dict[str, Any]:
    return {
        "logprob_mean": s.logprob_mean, "logprob_max": s.logprob_max, "loss_max": max(s.losses, default=0.0),
        "grad_norm_max_relative": max(s.grad_norms, default=0.0),
        "checksum_max": max((max(v.values()) for v in s.checksums.values()), default=0.0),
        "topk_min_overlap": min(s.topk_overlap.values(), default=1.0),
    }  # fmt: skip


# --- judging ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Comparison:
    checks: list[Check]
    layer_differences: dict[str, list[tuple[str, float]]]  # model -> (point, max |d| / tolerance) in forward order
    first_fault: dict[str, str | None]  # model -> the first point out of tolerance

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": "fail" if self.failed else "ok",
            "first_fault": self.first_fault,
            "checks": [c.to_dict() for c in self.checks],
            # ratio: |d| / tolerance; null where the tolerance is 0 and the values differ (exact mode)
            "layer_differences": {
                m: [{"point": p, "ratio": r if math.isfinite(r) else None} for p, r in v]
                for m, v in self.layer_differences.items()
            },
        }


def _judge(name: str, value: float, tolerance: Any, detail: str, *, at_least: bool = False) -> Check:
    limit = _finite(f"tolerance of {name}", tolerance)
    bad = not math.isfinite(value) or (value < limit if at_least else value > limit)
    sign = ">=" if at_least else "<="
    return Check(name, FAIL if bad else OK, f"{detail} {value:.3g} (allowed {sign} {limit:.3g})")


def compare(
    run: Mapping[str, Any],
    against: Mapping[str, Any],
    ref: Mapping[str, Any],
    mode: str = "reference",
    models: Sequence[str] | None = None,
    precise: Mapping[str, Any] | None = None,
) -> Comparison:
    """Judge ``run`` against ``against`` (the reference's run of the same dtype, or another run) with tolerances from
    ``ref``'s measured errors; ``exact``: every value must be equal. ``models``: the models to judge (default: every
    model of ``against``; one the run lacks fails). ``precise``: the same job as ``run`` in the next wider dtype on
    the run's own platform: then the run's own error is measured and counted, instead of assumed (module docstring)."""
    if mode not in MODES:
        raise ParityCompareError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    dtype = run_dtype(run)
    if run_dtype(against) != dtype:
        raise ParityCompareError(f"{run.get('_path')} is {dtype}, {against.get('_path')} is {run_dtype(against)}: "
                                 "compare runs of one dtype")  # fmt: skip
    expected = list(models) if models else models_of(against)
    unknown = [m for m in expected if m not in models_of(against)]
    if unknown:
        raise ParityCompareError(f"--model {', '.join(unknown)}: {against.get('_path')} has "
                                 f"{', '.join(models_of(against))}")  # fmt: skip
    limits = _limits(run, against, ref, precise, expected) if mode != "exact" else {}
    checks: list[Check] = []
    layers: dict[str, list[tuple[str, float]]] = {}
    faults: dict[str, str | None] = {}
    for model in models_of(run):
        if model not in expected:
            checks.append(Check(f"{model}.model", WARN, "not judged (not among the models compared)"))
    for model in expected:
        if model not in models_of(run):
            checks.append(Check(f"{model}.model", FAIL, f"the run has no {model} results"))
            continue
        values, other = model_values(run, model), model_values(against, model)  # malformed: ParityCompareError
        try:
            s = spread(values, other)
        except ValueError as exc:  # shapes that differ: a FAIL, not a bad input
            checks.append(Check(f"{model}.shape", FAIL, f"not comparable: {exc}"))
            continue
        tol = limits.get(model) if mode != "exact" else None
        model_checks, layers[model], faults[model] = _model_checks(model, s, tol, model_values(run, model))
        checks += model_checks
    return Comparison(checks, layers, faults)


def _limits(run, against, ref, precise, models) -> dict[str, Any]:
    """The tolerances per model: the reference's measured error plus the run's (measured with ``precise``, else
    assumed equal to the reference's)."""
    dtype = run_dtype(run)
    table = _mapping(f"{ref.get('_path')}: errors", ref.get("errors"))
    if dtype not in table:
        raise ParityCompareError(
            f"{ref.get('_path')}: no measured errors for dtype {dtype} (it has {', '.join(table)})"
        )
    reference_errors = {
        m: _mapping(f"errors.{dtype}.{m}", e) for m, e in _mapping(f"errors.{dtype}", table[dtype]).items()
    }
    missing = [m for m in models if m not in reference_errors]
    if missing:
        raise ParityCompareError(f"{ref.get('_path')}: no measured errors for model {', '.join(missing)}")
    candidate = None
    if precise is not None:
        if run_dtype(precise) != PRECISE.get(dtype):
            raise ParityCompareError(f"--precise {precise.get('_path')}: a {run_dtype(precise)} run; a {dtype} run's "
                                     f"error is measured against {PRECISE.get(dtype, 'nothing wider')}")  # fmt: skip
        if precise.get("device") != run.get("device"):
            where = f"{precise.get('device')}, the run on {run.get('device')}"
            raise ParityCompareError(f"--precise {precise.get('_path')} ran on {where}: the run's error is measured "
                                     "on its own platform")  # fmt: skip
        candidate = errors(_only(run, models), _only(precise, models))
        # the two platforms' wider-dtype runs stand for the exact values: measure how far apart those are too
        wider = _mapping(f"{ref.get('_path')}: runs", ref.get("runs")).get(run_dtype(precise))
        if wider is None:
            raise ParityCompareError(f"{ref.get('_path')}: no {run_dtype(precise)} run to measure --precise against")
        wider = {
            **_mapping(f"runs.{run_dtype(precise)}", wider),
            "_path": f"{ref.get('_path')}#runs.{run_dtype(precise)}",
        }
        apart = errors(_only(precise, models), _only(wider, models))
        candidate = {m: _add_errors(candidate[m], apart[m]) for m in models}
    try:
        return tolerances(against, {m: reference_errors[m] for m in models}, candidate)
    except (KeyError, IndexError, TypeError) as exc:
        raise ParityCompareError(f"{ref.get('_path')}: malformed errors ({type(exc).__name__}: {exc})") from None


def _add_errors(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two error profiles added term by term: |X - R| <= |X - T'| + |T' - T| + |T - R|."""
    out: dict[str, Any] = {}
    for key, value in a.items():
        other = b[key]
        if isinstance(value, list):
            out[key] = [x + y for x, y in zip(value, other, strict=True)]
        elif isinstance(value, Mapping):
            out[key] = {k: v + other.get(k, 0.0) for k, v in value.items()}
        else:
            out[key] = value + other
    return out


def _only(run: Mapping[str, Any], models: Sequence[str]) -> dict[str, Any]:
    present = _mapping(f"{run.get('_path')}: models", run.get("models"))
    missing = [m for m in models if m not in present]
    if missing:
        raise ParityCompareError(f"{run.get('_path')}: has no {', '.join(missing)} results")
    return {**run, "models": {m: present[m] for m in models}}


def _model_checks(model: str, s: Spread, tol: Mapping[str, Any] | None, values: ModelValues):
    """(checks, per-point |d| / tolerance, the first point out of tolerance) of one model; ``tol`` None: exact."""
    checks = _logprob_checks(model, s, tol) + _training_checks(model, s, tol) + _topk_checks(model, s, tol)
    point_checks, ratios, first = _checksum_checks(model, s, tol, values)
    return checks + point_checks, ratios, first


def _logprob_checks(model: str, s: Spread, tol: Mapping[str, Any] | None) -> list[Check]:
    def limit(key: str) -> Any:
        return 0.0 if tol is None else tol.get(key)

    return [
        _judge(f"{model}.logprobs.mean", s.logprob_mean, limit("logprob_mean"), "mean |d log-prob| per token"),
        _judge(f"{model}.logprobs.max", s.logprob_max, limit("logprob_max"), "max |d log-prob| per token"),
        _judge(f"{model}.after-training.mean", s.after_logprob_mean, limit("after_logprob_mean"), "mean |d log-prob|"),
        _judge(f"{model}.after-training.max", s.after_logprob_max, limit("after_logprob_max"), "max |d log-prob|"),
    ]


def _training_checks(model: str, s: Spread, tol: Mapping[str, Any] | None) -> list[Check]:
    loss_tol = [0.0] * len(s.losses) if tol is None else _list("tolerances.losses", tol.get("losses"))
    grad_tol = [0.0] * len(s.grad_norms) if tol is None else _list("tolerances.grad_norms", tol.get("grad_norms"))
    if len(loss_tol) != len(s.losses) or len(grad_tol) != len(s.grad_norms):
        steps = f"the reference's tolerances cover {len(loss_tol)} steps, the run has {len(s.losses)}"
        return [Check(f"{model}.train", FAIL, steps)]
    checks = [
        _judge(f"{model}.loss.step{i}", d, t, "|d loss|")
        for i, (d, t) in enumerate(zip(s.losses, loss_tol, strict=True))
    ]
    for i, (d, t) in enumerate(zip(s.grad_norms, grad_tol, strict=True)):
        checks.append(_judge(f"{model}.grad-norm.step{i}", d, t, "relative |d grad norm|"))
    return checks


def _topk_checks(model: str, s: Spread, tol: Mapping[str, Any] | None) -> list[Check]:
    limits = {} if tol is None else _mapping("tolerances.topk_min_overlap", tol.get("topk_min_overlap"))
    checks = []
    for layer, value in s.topk_overlap.items():
        limit = 1.0 if tol is None else limits.get(layer)
        if limit is None:
            checks.append(Check(f"{model}.topk.{layer}", FAIL, "the reference has no tolerance for this layer"))
            continue
        checks.append(_judge(f"{model}.topk.{layer}", value, limit, "overlap of the selected keys", at_least=True))
    checks += [
        Check(f"{model}.topk.{layer}", FAIL, "the run recorded no top-k for this DSA layer") for layer in s.missing_topk
    ]
    return checks


def _ratio(difference: float, tolerance: float) -> float:
    if tolerance:
        return difference / tolerance
    return math.inf if difference else 0.0


def _checksum_checks(model: str, s: Spread, tol: Mapping[str, Any] | None, values: ModelValues):
    limits = {} if tol is None else _mapping("tolerances.checksums", tol.get("checksums"))
    checks, ratios, first = [], [], None
    for point, differences in s.checksums.items():
        exact = dict.fromkeys(STATISTICS, 0.0)
        limit = exact if tol is None else _mapping(f"tolerances.checksums.{point}", limits.get(point))
        allowed = {stat: _finite(f"tolerance of {point}.{stat}", limit.get(stat)) for stat in STATISTICS}
        ratios.append((point, max(_ratio(differences[stat], allowed[stat]) for stat in STATISTICS)))
        if first is None and any(differences[stat] > allowed[stat] for stat in STATISTICS):
            first = point
    # a fused indexer never materialises q and k: those points alone may be absent, and they say so
    fused = [p for p in s.missing_points if p.endswith((".indexer.q", ".indexer.k")) and not values.indexer_qk]
    for point in (p for p in s.missing_points if p not in fused):
        checks.append(Check(f"{model}.checksum.{point}", FAIL, "the run has no checksum at this point"))
        first = first or point
    if fused:
        detail = f"{len(fused)} indexer q/k points not comparable: this run's indexer ran inside a fused kernel"
        checks.append(Check(f"{model}.checksum.indexer", WARN, detail + " (its top-k and attention are compared)"))
    if s.extra_points:
        shown = ", ".join(s.extra_points[:4]) + (" ..." if len(s.extra_points) > 4 else "")
        checks.append(
            Check(f"{model}.checksum.extra", WARN, f"{len(s.extra_points)} points the other run has not: {shown}")
        )
    if first is None:
        checks.append(Check(f"{model}.checksums", OK, f"{len(s.checksums)} points within tolerance"))
        return checks, ratios, first
    differences = s.checksums.get(first)
    shown = ", ".join(f"|d {k}| {v:.3g}" for k, v in differences.items()) if differences else "absent"
    detail = f"first point out of tolerance: {first} ({shown}); every point before it agrees"
    checks.append(Check(f"{model}.checksums", FAIL, detail, fix=_localise(first)))
    return checks, ratios, first


def _localise(point: str) -> str:
    """What the first failing point says about the fault."""
    _, _, name = point.partition("/")
    if name.endswith(".indexer.k_norm"):
        return "the DSA indexer's key norm differs (its eps, its dtype or its weights)"
    if name.endswith((".indexer.q", ".indexer.k")):
        return "the indexer's query or key differ before the scores (a Hadamard rotation, RoPE layout, projection)"
    if name.endswith(".self_attention"):
        return "this layer's attention differs (its input norm, the top-k it attends over, the attention kernel)"
    if name.endswith(".mlp"):
        return "this layer's MLP/MoE differs (its norm, the router, the experts)"
    return "the values first differ here: look at the operator that produces this tensor"


# --- output -----------------------------------------------------------------------------------------------------------
def plot(result: Comparison, path: str | Path, title: str) -> None:
    """Per model, each checksum point's largest |d| / tolerance in forward order; 1.0 is the tolerance."""
    import io

    import matplotlib

    from verl_npu import atomic

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m, v in result.layer_differences.items() if v]
    fig, axes = plt.subplots(len(models) or 1, 1, figsize=(12, 3.2 * max(len(models), 1)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=False):
        values = result.layer_differences[model]
        ratios = [min(r, 1e6) if math.isfinite(r) else 1e6 for _, r in values]
        ax.plot(range(len(values)), [max(r, 1e-6) for r in ratios], marker=".", linewidth=1)
        ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="tolerance")
        ax.set_yscale("log")
        ax.set_title(f"{model}: |d| / tolerance per checksum point (first fault: {result.first_fault.get(model)})")
        step = max(1, len(values) // 24)
        ax.set_xticks(range(0, len(values), step))
        ax.set_xticklabels([values[i][0] for i in range(0, len(values), step)], rotation=70, fontsize=6)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    atomic.write_bytes(path, buffer.getvalue())


def reference_run(ref: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    runs = _mapping(f"{ref.get('_path')}: runs", ref.get("runs"))
    if dtype not in runs:
        raise ParityCompareError(f"{ref.get('_path')}: no {dtype} run (it has {', '.join(runs)})")
    return {**_mapping(f"{ref.get('_path')}: runs.{dtype}", runs[dtype]), "_path": f"{ref.get('_path')}#runs.{dtype}"}


def as_table_title(run: Mapping[str, Any], against: Mapping[str, Any], mode: str) -> str:
    return (f"verl-npu parity: {run.get('_path')} ({run.get('device')}, {run.get('dtype')}, path {run.get('path')}) "
            f"vs {against.get('_path')} ({against.get('device')}), mode {mode}")  # fmt: skip


def models_in(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({m for r in runs for m in models_of(r)})
