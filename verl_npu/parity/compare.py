"""``verl-npu parity compare`` and ``parity reference``: a run against the CUDA reference, or two runs against
each other, with tolerances from errors measured on the reference device (docs/parity.md).

The judgement, layer by layer (verl_npu/parity/replay.py, verl_npu/parity/gradients.py). A run made with
``--replay-from SOURCE`` fed every block SOURCE's input; per model it is judged against SOURCE on what each block
added (relative L2), the log-probs from SOURCE's last hidden state, every DSA layer's top-k, the gradient probe per
parameter group (at SOURCE's activations) and step 0's update against AdamW's from its own gradients. Each tolerance
is TRIANGLE x the reference device's error of the same block or group, measured the same way one precision wider
(|X - R| <= |X - T| + |R - T|, X assumed no less accurate than R; fp32 gradient groups GRADIENT_REDUCTION_ORDER x
more), at least the dtype's unit roundoff. Two
judgements: ``reference`` mode with SOURCE the reference's run of the run's dtype (the nightly's fp32 runs), and
``--precise FP32RUN`` with SOURCE the bf16 run's own node's fp32 run (the bf16 error measured against fp32 on the
reference device). The first block out of tolerance, by depth, names the fault.

The summary, end to end: per-token log-probs of the whole forward (mean and max of the absolute differences) and
after training, each training step's loss and gradient norm, each DSA layer's top-k overlap, and the activation
checksums (verl_npu/parity/probes.py), with tolerances of 2 x the reference's measured error (for a checksum, relative
to the tensor's RMS and the largest measured at its depth or shallower). Where a layer-by-layer judgement exists they
are warnings: errors carried through every layer before them make them weak (bf16) or chaotic (training). A model
whose block tensors are not recorded (``glm5_2_fused_shape``) is judged end to end against its node's fp32 run
(``--precise``; values after the first update are a summary) and only summarised against another platform's run; the
``pair`` mode (two runs of one node) is judged end to end; ``exact`` (two runs of one build on one machine) fails on
any difference. A DSA layer's top-k never passes below TOPK_MARGIN of the way from what a random selection scores to
full agreement.

Anything missing, malformed, empty or not finite fails: a comparison never passes on what it could not compare. One
point may be absent: an Ascend run whose indexer ran inside MindSpeed's fused kernel has no indexer q/k tensors; that
indexer is judged by its layer's top-k over every query row, which both runs must hold. Nor is one of two values
chosen: a key given twice in one JSON object is refused (``json.loads`` keeps the last), and a run's ``steps`` must
be a JSON integer from 1 that each model's losses and gradient norms match.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_npu.bounded_read import MIB, NotReadable, read_bytes
from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.errors import UserError
from verl_npu.inputs import DuplicateKey, loads_json
from verl_npu.parity.probes import STATISTICS
from verl_npu.parity.run_format import DTYPES, FORMAT, MAX_STEPS, RUN_KIND

if TYPE_CHECKING:
    import torch

REFERENCE_KIND = "verl-npu parity reference"
MAX_FILE_BYTES = 256 * MIB
TRIANGLE = 2.0  # default mode: |X - R| <= |X - T| + |R - T| <= 2 |R - T| (module docstring)
# An fp32 gradient probe sums over every token of the batch, in whatever order the platform's kernels reduce: there a
# platform is not "no less accurate" than the reference. Measured: a clean CPU fp32 run's group errors reach 2.3x the
# nvidia-h200's own error against fp64 (glm5_2 layers.6.mlp) while every block stays within 0.72 of its tolerance, so
# fp32 and fp64 gradient groups allow this much more (docs/parity.md, "Gradients and the update, one step").
GRADIENT_REDUCTION_ORDER = 3.0
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp32": 2.0**-24, "fp64": 2.0**-53}
PRECISE = {"bf16": "fp32", "fp32": "fp64"}  # the precision each dtype's error is measured against
MODES = ("reference", "pair", "exact")
POINT = re.compile(r"mb([0-9]+)/(embedding|final_layernorm|logits|layers\.([0-9]+)(\.[a-z_]+)*)(#[0-9]+)?")
FUSED_INDEXER_POINTS = (".indexer.q", ".indexer.k")
# a top-k floor sits at least this share of the way from what a random selection of k keys scores to full agreement
# (docs/parity.md, "Top-k over every query row": the margin and the measured clean overlap it leaves room for)
TOPK_MARGIN = 0.25
CROSS_PLATFORM_END_TO_END = (
    "no block tensors of this model in the reference: against another platform's run it is a summary only (one "
    "near-tie top-k key that fp32 rounding flips changes every later layer: a clean CPU fp32 run of "
    "glm5_2_fused_shape differs from nvidia-h200's by 0.85 in a log-prob); its bf16 run is judged against its node's "
    "fp32 run (docs/parity.md)"
)


class ParityCompareError(UserError):
    """A run or reference file that cannot be compared: unreadable, malformed, empty, or of another kind."""


# --- reading what comes from outside -------------------------------------------------------------------------------
def _finite(where: str, value: Any) -> float:
    try:
        good = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        good = False
    if not good:
        raise ParityCompareError(f"{where}={str(value)[:40]!r}: expected a finite number")
    return float(value)


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ParityCompareError(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


def _list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ParityCompareError(f"{where}: expected a JSON list, found {type(value).__name__}")
    return value


def _index(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParityCompareError(f"{where}={value!r}: expected a non-negative integer")
    return value


def _kind_and_format(where: str, data: Mapping[str, Any], kind: str) -> None:
    if data.get("kind") != kind:
        raise ParityCompareError(f"{where}: kind={data.get('kind')!r}: expected {kind!r}")
    if type(data.get("format")) is not int or data["format"] != FORMAT:
        raise ParityCompareError(f"{where}: format={data.get('format')!r}: this verl-npu reads format {FORMAT}")


def run_steps(run: Mapping[str, Any]) -> int:
    """The training steps a run says it recorded: a JSON integer from 1 (a run of no steps compares nothing)."""
    steps = run.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ParityCompareError(f"{run.get('_path', 'run')}: steps={steps!r}: expected a JSON integer from 1 to "
                                 f"{MAX_STEPS} (the training steps the run recorded)")  # fmt: skip
    return steps


def load(path: str | Path, kind: str) -> dict[str, Any]:
    """A parity run or reference file (``kind``), read bounded and checked for its kind and format."""
    path = Path(path)
    try:
        data = loads_json(read_bytes(path, MAX_FILE_BYTES).decode("utf-8"))
    except NotReadable as exc:
        raise ParityCompareError(f"{path}: cannot read it ({exc})") from None
    except DuplicateKey as exc:
        raise ParityCompareError(f"{path}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ParityCompareError(f"{path}: not a JSON file ({exc})") from None
    data = dict(_mapping(str(path), data))
    _kind_and_format(str(path), data, kind)
    data["_path"] = str(path)
    if kind == RUN_KIND:
        run_steps(data)
    return data


def run_dtype(run: Mapping[str, Any]) -> str:
    dtype = run.get("dtype")
    if dtype not in DTYPES:
        raise ParityCompareError(f"{run.get('_path', 'run')}: dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def depth(point: str) -> tuple[int, int]:
    """(depth in the forward pass, micro-batch) of a checksum point: -1 the embedding, N layer N, 10**6 after the
    last layer (final norm, logits); a point of each micro-batch is as deep as the same point of another."""
    m = POINT.fullmatch(point)
    if m is None:
        raise ParityCompareError(f"checksum point {point!r}: expected mbN/embedding, mbN/layers.N[.module], ...")
    name, layer = m[2], m[3]
    position = int(layer) if layer is not None else -1 if name == "embedding" else 10**6
    return position, int(m[1])


# --- the values of a run ------------------------------------------------------------------------------------------
def _logprobs(where: str, value: Any) -> list[list[float]]:
    rows = _list(where, value)
    out = [
        [_finite(f"{where}[{i}][{j}]", x) for j, x in enumerate(_list(f"{where}[{i}]", r))] for i, r in enumerate(rows)
    ]
    if not out or not all(out):
        raise ParityCompareError(f"{where}: empty: nothing to compare")
    return out


def _series(where: str, value: Any) -> list[float]:
    out = [_finite(f"{where}[{i}]", x) for i, x in enumerate(_list(where, value))]
    if not out:
        raise ParityCompareError(f"{where}: empty: nothing to compare")
    return out


def _checksums(where: str, value: Any) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for i, record in enumerate(_list(where, value)):
        record = _mapping(f"{where}[{i}]", record)
        point = record.get("point")
        if not isinstance(point, str):
            raise ParityCompareError(f"{where}[{i}].point={point!r}: expected a point name")
        depth(point)  # a name it can place, or a named error
        if point in out:
            raise ParityCompareError(f"{where}[{i}]: point {point!r} is recorded twice")
        out[point] = {stat: _finite(f"{where}[{i}].{stat}", record.get(stat)) for stat in STATISTICS}
    if not out:
        raise ParityCompareError(f"{where}: empty: nothing to compare")
    return out


Rows = dict[tuple[int, int], frozenset[int]]  # (sequence, query) -> selected keys


@dataclasses.dataclass(frozen=True)
class TopK:
    """One DSA layer's recorded selection: ``rows``, exact but possibly a sample of the query rows; ``every_row``,
    every judged query row within the record's key sample (None: an older record that has not)."""

    k: int
    rows: Rows
    every_row: Rows | None


def _topk(where: str, value: Any) -> dict[str, TopK]:
    from verl_npu.parity.probes import all_rows_sets, topk_sets

    out = {}
    for layer, record in _mapping(where, value).items():
        record = _mapping(f"{where}.{layer}", record)
        rows = _list(f"{where}.{layer}.rows", record.get("rows"))
        lengths = _list(f"{where}.{layer}.lengths", record.get("lengths"))
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 2:
                raise ParityCompareError(f"{where}.{layer}.rows[{i}]={row!r}: expected [sequence, query]")
            _index(f"{where}.{layer}.rows[{i}][0]", row[0])
            _index(f"{where}.{layer}.rows[{i}][1]", row[1])
        for i, n in enumerate(lengths):
            _index(f"{where}.{layer}.lengths[{i}]", n)
        if not rows or len(rows) != len(lengths) or len({tuple(r) for r in rows}) != len(rows):
            raise ParityCompareError(f"{where}.{layer}: rows and lengths must be non-empty, as many, and unique")
        k = _index(f"{where}.{layer}.k", record.get("k"))
        try:
            out[layer] = TopK(k, topk_sets(record), all_rows_sets(record))
        except Exception as exc:  # base64 and keys that do not fit the rows: malformed, named
            raise ParityCompareError(f"{where}.{layer}: malformed top-k record ({type(exc).__name__}: {exc})") from None
    return out


@dataclasses.dataclass(frozen=True)
class ModelValues:
    logprobs: list[list[float]]
    after_logprobs: list[list[float]]
    losses: list[float]
    grad_norms: list[float]
    checksums: dict[str, dict[str, float]]  # point -> statistic (mean, rms, proj) -> value
    topk: dict[str, TopK]
    fused_indexer: bool  # an Ascend run whose indexer ran inside MindSpeed's fused kernel (no q/k points)


def model_values(run: Mapping[str, Any], model: str) -> ModelValues:
    where = f"{run.get('_path', 'run')}: models.{model}"
    m = _mapping(where, _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model))
    evaluation = _mapping(f"{where}.eval", m.get("eval"))
    train = _mapping(f"{where}.train", m.get("train"))
    after = _mapping(f"{where}.after_training", m.get("after_training"))
    losses = _series(f"{where}.train.losses", train.get("losses"))
    grad_norms = _series(f"{where}.train.grad_norms", train.get("grad_norms"))
    steps = run_steps(run)
    if not len(losses) == len(grad_norms) == steps:
        raise ParityCompareError(f"{where}.train: {len(losses)} losses and {len(grad_norms)} gradient norms for "
                                 f"steps={steps}: one of each per step")  # fmt: skip
    return ModelValues(
        logprobs=_logprobs(f"{where}.eval.logprobs", evaluation.get("logprobs")),
        after_logprobs=_logprobs(f"{where}.after_training.logprobs", after.get("logprobs")),
        losses=losses,
        grad_norms=grad_norms,
        checksums=_checksums(f"{where}.eval.checksums", evaluation.get("checksums")),
        topk=_topk(f"{where}.eval.topk", evaluation.get("topk", {})),
        fused_indexer=run.get("platform") == "ascend" and evaluation.get("indexer_qk") is False,
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
    if set(a) != set(b) or not a:
        raise ValueError("the runs stored different (or no) query rows")
    return sum(len(a[r] & b[r]) / max(len(a[r]), len(b[r]), 1) for r in a) / len(a)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How one layer's selection agrees with another run's: ``overlap`` over ``rows`` query rows (``every_row``:
    all of them, within the key sample, pooled as sum |A & B| / sum (|A| + |B|) / 2; else the exact rows stored, the
    mean of each row's |A & B| / max(|A|, |B|)), and ``random``: what a selection of k keys drawn at random would
    score there, the same way (a row's k of its query + 1 causal keys keeps k / (query + 1) of any set in
    expectation)."""

    overlap: float
    random: float
    rows: int
    every_row: bool


def agreement(a: TopK, b: TopK) -> Agreement:
    """``a``'s selection against ``b``'s: over every query row where both recorded them, else their exact rows."""
    if a.k != b.k:
        raise ValueError(f"the runs selected different numbers of keys (k {a.k} vs {b.k})")
    if a.every_row is not None and b.every_row is not None:
        if set(a.every_row) != set(b.every_row) or not b.every_row:
            raise ValueError("the runs recorded different (or no) query rows")
        # per row, the mean of the two counts: a max would grow with the sample's spread of counts, not the overlap
        weights = {r: (len(a.every_row[r]) + len(b.every_row[r])) / 2 for r in b.every_row}
        total = sum(weights.values())
        if not total:
            raise ValueError("no selected key falls in the key sample of any row")
        shared = sum(len(a.every_row[r] & b.every_row[r]) for r in b.every_row)
        random = sum(w * min(1.0, b.k / (r[1] + 1)) for r, w in weights.items()) / total
        return Agreement(shared / total, random, len(b.every_row), True)
    exact = overlap(a.rows, b.rows)  # first: rows that differ (or none) are a ValueError
    random = sum(min(1.0, b.k / (r[1] + 1)) for r in b.rows) / len(b.rows)
    return Agreement(exact, random, len(b.rows), False)


def topk_floor(measured_floor: float, random: float) -> float:
    """The least overlap a layer may show: its measured floor, raised to TOPK_MARGIN of the way from random selection
    to 1 where the measured error would let a random selection pass."""
    return max(measured_floor, random + TOPK_MARGIN * (1.0 - random))


@dataclasses.dataclass(frozen=True)
class Spread:
    """How one run of a model differs from another (the second is the reference side)."""

    logprob_mean: float
    logprob_max: float
    after_logprob_mean: float
    after_logprob_max: float
    losses: list[float]  # per step, absolute
    grad_norms: list[float]  # per step, relative to the second run's
    checksums: dict[str, dict[str, float]]  # point -> statistic -> |difference|, points of both runs
    missing_points: list[str]  # points of the second run the first has not
    extra_points: list[str]  # points of the first run the second has not
    topk_overlap: dict[str, float]  # layer -> overlap, layers of both runs
    missing_topk: list[str]
    extra_topk: list[str]
    topk: dict[str, Agreement] = dataclasses.field(default_factory=dict)  # layer -> how it was measured


def spread(a: ModelValues, b: ModelValues) -> Spread:
    """How ``a`` differs from ``b``. Raises ValueError for shapes that differ (a FAIL where it is judged)."""
    _same_shape("eval log-probs", a.logprobs, b.logprobs)
    _same_shape("log-probs after training", a.after_logprobs, b.after_logprobs)
    if len(a.losses) != len(b.losses):
        raise ValueError(f"training steps differ ({len(a.losses)} vs {len(b.losses)})")
    d = [abs(x - y) for x, y in zip(_flat(a.logprobs), _flat(b.logprobs), strict=True)]
    d_after = [abs(x - y) for x, y in zip(_flat(a.after_logprobs), _flat(b.after_logprobs), strict=True)]
    both = [p for p in b.checksums if p in a.checksums]
    topk = {layer: agreement(a.topk[layer], selection) for layer, selection in b.topk.items() if layer in a.topk}
    return Spread(
        logprob_mean=sum(d) / len(d),
        logprob_max=max(d),
        after_logprob_mean=sum(d_after) / len(d_after),
        after_logprob_max=max(d_after),
        losses=[abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)],
        grad_norms=[abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a.grad_norms, b.grad_norms, strict=True)],
        checksums={p: {s: abs(a.checksums[p][s] - b.checksums[p][s]) for s in STATISTICS} for p in both},
        missing_points=[p for p in b.checksums if p not in a.checksums],
        extra_points=[p for p in a.checksums if p not in b.checksums],
        topk_overlap={layer: agreed.overlap for layer, agreed in topk.items()},
        missing_topk=[layer for layer in b.topk if layer not in a.topk],
        extra_topk=[layer for layer in a.topk if layer not in b.topk],
        topk=topk,
    )


# --- errors and tolerances ------------------------------------------------------------------------------------------
def errors(primary: Mapping[str, Any], precise: Mapping[str, Any], repeat: Mapping[str, Any] | None = None):
    """Per model, ``primary``'s measured error: its spread against ``precise`` (the same job one dtype wider, for
    the exact values) and against ``repeat`` (the same job again), the larger of the two. Both must hold every
    value ``primary`` has. Raises ParityCompareError for runs that cannot be measured against each other."""
    out: dict[str, Any] = {}
    for model in models_of(primary):
        ref = model_values(primary, model)
        spreads = []
        for other in (precise, repeat):
            if other is None:
                continue
            try:
                s = spread(model_values(other, model), ref)
            except ValueError as exc:
                raise ParityCompareError(f"{other.get('_path')} cannot measure {primary.get('_path')}: {exc}") from None
            if s.missing_points or s.missing_topk:
                missing = [*s.missing_points, *s.missing_topk][:4]
                raise ParityCompareError(f"{other.get('_path')} cannot measure {primary.get('_path')} ({model}): it "
                                         f"lacks {', '.join(missing)}")  # fmt: skip
            spreads.append(s)
        replayed = replay_errors(replay_spread(primary, precise, model)) if has_replay(primary, model) else None

        def worst(name: str, spreads: list[Spread] = spreads) -> float:
            return max(getattr(s, name) for s in spreads)

        out[model] = {
            "logprob_mean": worst("logprob_mean"),
            "logprob_max": worst("logprob_max"),
            "after_logprob_mean": worst("after_logprob_mean"),
            "after_logprob_max": worst("after_logprob_max"),
            "losses": [max(s.losses[i] for s in spreads) for i in range(len(ref.losses))],
            "grad_norms": [max(s.grad_norms[i] for s in spreads) for i in range(len(ref.grad_norms))],
            "checksums": _depth_relative(ref, spreads),
            "topk_disagreement": {layer: 1.0 - min(s.topk_overlap[layer] for s in spreads) for layer in ref.topk},
            "replay": replayed,  # each block's error fed the wider run's input, and step 0's gradients and update
        }
    return out


def _depth_relative(ref: ModelValues, spreads: Sequence[Spread]) -> dict[str, dict[str, float]]:
    """Per point and statistic, the largest relative error (|d| / the point's RMS) at its depth or shallower."""
    at_depth: dict[int, dict[str, float]] = {}
    for point, stats in ref.checksums.items():
        scale = stats["rms"] or 1.0
        level = at_depth.setdefault(depth(point)[0], dict.fromkeys(STATISTICS, 0.0))
        for stat in STATISTICS:
            level[stat] = max(level[stat], *(s.checksums[point][stat] / scale for s in spreads))
    running, cumulative = dict.fromkeys(STATISTICS, 0.0), {}
    for level in sorted(at_depth):
        running = {stat: max(running[stat], at_depth[level][stat]) for stat in STATISTICS}
        cumulative[level] = running
    return {point: dict(cumulative[depth(point)[0]]) for point in ref.checksums}


def _error_value(where: str, value: Any) -> float:
    """A measured error from outside: finite and non-negative."""
    x = _finite(where, value)
    if x < 0:
        raise ParityCompareError(f"{where}={x}: an error is never negative")
    return x


def _profile(where: str, value: Any) -> dict[str, Any]:
    """An error profile (one model's ``errors`` entry) from outside, every number finite and non-negative."""
    e = _mapping(where, value)

    def number(key: str, v: Any) -> float:
        return _error_value(f"{where}.{key}", v)

    scalars = {
        k: number(k, e.get(k)) for k in ("logprob_mean", "logprob_max", "after_logprob_mean", "after_logprob_max")
    }
    return {
        **scalars,
        "losses": [number(f"losses[{i}]", v) for i, v in enumerate(_list(f"{where}.losses", e.get("losses")))],
        "grad_norms": [
            number(f"grad_norms[{i}]", v) for i, v in enumerate(_list(f"{where}.grad_norms", e.get("grad_norms")))
        ],
        "checksums": {
            p: {s: number(f"checksums.{p}.{s}", _mapping(f"{where}.checksums.{p}", v).get(s)) for s in STATISTICS}
            for p, v in _mapping(f"{where}.checksums", e.get("checksums")).items()
        },
        "topk_disagreement": {
            layer: number(f"topk_disagreement.{layer}", v)
            for layer, v in _mapping(f"{where}.topk_disagreement", e.get("topk_disagreement")).items()
        },
    }  # fmt: skip


def _add(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two error profiles added term by term (a term ``b`` lacks counts as ``a``'s: assumed no better)."""
    out: dict[str, Any] = {}
    for key, value in a.items():
        other = b.get(key, value)
        if key == "replay":  # block errors are judged one at a time (replay_checks), never summed
            continue
        if isinstance(value, list):
            out[key] = [x + (other[i] if i < len(other) else x) for i, x in enumerate(value)]
        elif isinstance(value, Mapping):
            out[key] = {k: _add(v, other.get(k, v)) if isinstance(v, Mapping) else v + other.get(k, v)
                        for k, v in value.items()}  # fmt: skip
        else:
            out[key] = value + other
    return out


def tolerances(run: Mapping[str, Any], total: Mapping[str, Any], resolution: str | None = None) -> dict[str, Any]:
    """Per model of ``total`` (error profiles: the sum the mode allows), the tolerances for comparing with ``run``
    (the reference side), each at least the rounding of the result itself in the dtype ``resolution`` (default:
    ``run``'s)."""
    u = UNIT_ROUNDOFF[resolution or run_dtype(run)]
    out: dict[str, Any] = {}
    for model, err in total.items():
        values = model_values(run, model)
        scale = max(abs(x) for x in _flat(values.logprobs))
        after = max(abs(x) for x in _flat(values.after_logprobs))
        if len(err["losses"]) != len(values.losses):
            raise ParityCompareError(
                f"errors of {model} cover {len(err['losses'])} steps, the run has {len(values.losses)}"
            )
        missing = [p for p in values.checksums if p not in err["checksums"]]
        missing += [layer for layer in values.topk if layer not in err["topk_disagreement"]]
        if missing:
            raise ParityCompareError(f"no measured error for {model} at {', '.join(missing[:4])}")
        out[model] = {
            "logprob_mean": max(err["logprob_mean"], u * scale),
            "logprob_max": max(err["logprob_max"], u * scale),
            "after_logprob_mean": max(err["after_logprob_mean"], u * after),
            "after_logprob_max": max(err["after_logprob_max"], u * after),
            "losses": [max(e, u * abs(x)) for e, x in zip(err["losses"], values.losses, strict=True)],
            "grad_norms": [max(e, u) for e in err["grad_norms"]],
            "checksums": {
                p: {s: max(err["checksums"][p][s], u) * stats["rms"] for s in STATISTICS}
                for p, stats in values.checksums.items()
            },
            "topk_min_overlap": {layer: max(0.0, 1.0 - err["topk_disagreement"][layer]) for layer in values.topk},
        }
    return out


def derive(primary: Mapping[str, Any], precise: Mapping[str, Any], repeat: Mapping[str, Any] | None) -> dict[str, Any]:
    """The default mode's tolerances of ``primary``'s dtype: twice its measured error (module docstring)."""
    measured = errors(primary, precise, repeat)
    return tolerances(primary, {m: _add(e, e) for m, e in measured.items()})


DERIVATION = (
    "layer by layer (the judgement): each block, fed the source's input, within 2 x the reference device's error "
    "of that block measured one precision wider (fp32 fed fp64's inputs, bf16 fed fp32's), in relative L2; "
    "likewise the log-probs from the source's last hidden state, each DSA layer's top-k (minimum overlap 1 - 2 x "
    "the measured key disagreement, raised to 25% of the way from a random selection's overlap to 1), each "
    "parameter group's gradient probe (at the source's activations; in fp32 and fp64 GRADIENT_REDUCTION_ORDER (3) x "
    "more, for the platform's reduction order) and step 0's update against AdamW's from the run's own gradients; "
    "every tolerance at least the dtype's unit roundoff. End to end (a summary): max(2 x the "
    "reference's measured error against the wider run and a second run, the unit roundoff x the value's "
    "magnitude); a checksum's error relative to the tensor's RMS and the largest at its layer or any layer before "
    "it. Why a sum: |X - R| <= |X - T| + |R - T| (T: the exact value); why 2: X assumed no less accurate than the "
    "reference."
)


def reference(runs: Mapping[str, Mapping[str, Any]], repeats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The reference file: the bf16, fp32 and fp64 runs, the bf16 and fp32 measured errors, the default tolerances
    and how they were derived. ``runs``: dtype -> run; ``repeats``: dtype -> a second bf16 and fp32 run."""
    missing = [d for d in ("bf16", "fp32", "fp64") if d not in runs] + [d for d in ("bf16", "fp32") if d not in repeats]
    if missing:
        raise ParityCompareError(f"a reference needs runs in bf16, fp32 and fp64 and repeats in bf16 and fp32; "
                                 f"missing {', '.join(missing)}")  # fmt: skip
    for dtype, run in [*runs.items(), *repeats.items()]:
        if run_dtype(run) != dtype:
            raise ParityCompareError(f"{run.get('_path', 'run')}: dtype {run_dtype(run)}, given as the {dtype} run")
    devices = {str(r.get("device")) for r in [*runs.values(), *repeats.values()]}
    if len(devices) != 1:
        raise ParityCompareError(f"the runs come from different devices ({', '.join(sorted(devices))})")
    measured, limits, spreads = {}, {}, {}
    for dtype in ("bf16", "fp32"):
        precise = PRECISE[dtype]
        measured[dtype] = errors(runs[dtype], runs[precise], repeats[dtype])
        limits[dtype] = derive(runs[dtype], runs[precise], repeats[dtype])
        spreads[dtype] = {}
        for model in models_of(runs[dtype]):
            ref = model_values(runs[dtype], model)
            spreads[dtype][model] = {
                precise: _summary(spread(model_values(runs[precise], model), ref)),
                "repeat": _summary(spread(model_values(repeats[dtype], model), ref)),
            }
    return {
        "kind": REFERENCE_KIND,
        "format": FORMAT,
        "device": next(iter(devices)),
        "versions": runs["bf16"].get("versions"),
        "derivation": DERIVATION,
        # the runs platforms are compared with and replayed from (fp64 only measures the reference's fp32 error)
        "runs": {dtype: _strip(runs[dtype]) for dtype in ("bf16", "fp32")},
        "errors": measured,  # the reference's measured error per dtype and model
        "tolerances": limits,  # the default mode's: twice the reference's error
        "measured_spreads": spreads,
    }


def _strip(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run as the reference keeps it: without its own replay's outputs (measured into ``errors`` already)."""
    out = {k: v for k, v in run.items() if not k.startswith("_")}
    models = {}
    for name, values in run["models"].items():
        evaluation = dict(values["eval"])
        if evaluation.get("replay") is not None:
            evaluation["replay"] = {"natural": evaluation["replay"]["natural"], "replayed": None}
        models[name] = {**values, "eval": evaluation}
    return {**out, "models": models}


def _summary(s: Spread) -> dict[str, Any]:
    return {
        "logprob_mean": s.logprob_mean, "logprob_max": s.logprob_max, "loss_max": max(s.losses),
        "grad_norm_max_relative": max(s.grad_norms),
        "checksum_max": max((max(v.values()) for v in s.checksums.values()), default=0.0),
        "topk_min_overlap": min(s.topk_overlap.values(), default=1.0),
    }  # fmt: skip


# --- judging ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Comparison:
    checks: list[Check]
    layer_differences: dict[str, list[tuple[str, float]]]  # model -> (point, max |d| / tolerance), by depth
    first_fault: dict[str, str | None]  # model -> the shallowest point out of tolerance (or missing)

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


def reference_run(ref: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    runs = _mapping(f"{ref.get('_path')}: runs", ref.get("runs"))
    if dtype not in runs:
        raise ParityCompareError(f"{ref.get('_path')}: no {dtype} run (it has {', '.join(runs)})")
    run = {**_mapping(f"{ref.get('_path')}: runs.{dtype}", runs[dtype]), "_path": f"{ref.get('_path')}#runs.{dtype}"}
    _kind_and_format(f"{ref.get('_path')}: runs.{dtype}", run, RUN_KIND)
    run_steps(run)
    return run


def compare(
    run: Mapping[str, Any],
    against: Mapping[str, Any],
    ref: Mapping[str, Any],
    mode: str = "reference",
    models: Sequence[str] | None = None,
    precise: Mapping[str, Any] | None = None,
) -> Comparison:
    """Judge ``run`` against ``against`` (the reference's run of the same dtype, or another run) with tolerances from
    ``ref``'s measured errors (module docstring); ``exact``: every value must be equal. ``models``: the models to
    judge (default: every model of ``against``; one the run lacks fails). ``precise``: a bf16 run's node's fp32 run,
    which the run was replayed from and is judged against layer by layer (end to end, a model whose block tensors
    are not recorded)."""
    if mode not in MODES:
        raise ParityCompareError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    dtype = run_dtype(run)
    if run_dtype(against) != dtype:
        raise ParityCompareError(f"{run.get('_path')} is {dtype}, {against.get('_path')} is {run_dtype(against)}: "
                                 "compare runs of one dtype")  # fmt: skip
    expected = list(models) if models else models_of(against)
    unknown = [m for m in expected if m not in models_of(against)]
    if unknown or not expected:
        raise ParityCompareError(f"--model {', '.join(unknown) or '(none)'}: {against.get('_path')} has "
                                 f"{', '.join(models_of(against)) or 'no models'}")  # fmt: skip
    judged = [m for m in expected if m in models_of(run)]
    checks = [Check(f"{m}.model", FAIL, f"the run has no {m} results") for m in expected if m not in judged]
    checks += [Check(f"{m}.model", WARN, "not judged (not among the models compared)") for m in models_of(run)
               if m not in expected]  # fmt: skip
    limits: dict[str, Any] = {}
    if mode != "exact" and judged:
        limits = tolerances(against, {m: _add(e, e) for m, e in _reference_errors(ref, dtype, judged).items()})
    layers: dict[str, list[tuple[str, float]]] = {}
    faults: dict[str, str | None] = {}
    for model in judged:
        values, other = model_values(run, model), model_values(against, model)
        replay_judged = False
        source = against if precise is None else _precise_source(run, precise)
        if mode == "reference" and has_replay(source, model):  # each block fed the source's input: the judgement
            label = "replay" if precise is None else "bf16-vs-own-fp32"
            measured = _replay_errors_of(ref, dtype, model)
            r_checks, layers[model], faults[model] = replay_checks(
                model, replay_spread(run, source, model), measured, dtype, label
            )
            checks += r_checks
            replay_judged = True
        if precise is not None and not replay_judged:  # no block tensors: end to end, against its node's fp32 run
            other = model_values(source, model)
        try:
            s = spread(values, other)
        except ValueError as exc:  # shapes that differ: a FAIL, not a bad input
            checks.append(Check(f"{model}.shape", FAIL, f"not comparable: {exc}"))
            faults[model] = "shape"
            continue
        model_checks, e2e_layers, e2e_fault = _model_checks(model, s, limits.get(model), values, mode)
        if replay_judged:  # end to end, errors carried through every layer: a summary, not the judgement
            model_checks = [_as_summary(c) for c in model_checks]
        elif mode == "reference" and precise is None:  # another platform's run, end to end: a summary (docstring)
            model_checks = [_as_summary(c) for c in model_checks]
            model_checks.append(Check(f"{model}.judged", WARN, CROSS_PLATFORM_END_TO_END))
        elif mode == "reference":  # after an update, a rounding that flips a selection changes everything: a summary
            model_checks = [_as_summary(c) if _after_an_update(c.check) else c for c in model_checks]
        else:
            layers[model], faults[model] = e2e_layers, e2e_fault
        checks += model_checks
    return Comparison(checks, layers, faults)


def _after_an_update(check: str) -> bool:
    """A check of a value computed after the first optimizer step: a later step's loss or gradient norm, the
    log-probs after training (the training checks of tests_npu/parity/test_parity.py measured how chaotic they are)."""
    name = check.partition(".")[2]
    if name.startswith("after-training."):
        return True
    kind, _, step = name.partition(".step")
    return kind in ("loss", "grad-norm") and step.isdigit() and int(step) >= 1


def _as_summary(check: Check) -> Check:
    if check.status != FAIL:
        return check
    return Check(check.check, WARN, f"summary, end to end (errors of every layer before it): {check.detail}",
                 fix=check.fix)  # fmt: skip


def _precise_source(run: Mapping[str, Any], precise: Mapping[str, Any]) -> Mapping[str, Any]:
    """--precise: the run's own wider run on its node, from which the run was replayed (bf16 against fp32)."""
    dtype, wider = run_dtype(run), run_dtype(precise)
    if wider != PRECISE.get(dtype) or dtype != "bf16":
        raise ParityCompareError(f"--precise {precise.get('_path')}: a {wider} run; a {dtype} run is judged against "
                                 "its node's fp32 run (--precise takes a bf16 run's fp32 run only)")  # fmt: skip
    if str(precise.get("device")) != str(run.get("device")):
        where = f"{precise.get('device')}, the run on {run.get('device')}"
        raise ParityCompareError(f"--precise {precise.get('_path')} ran on {where}: the run's error is measured on "
                                 "its own platform")  # fmt: skip
    return precise


def _replay_errors_of(ref: Mapping[str, Any], dtype: str, model: str) -> dict[str, Any]:
    where = f"{ref.get('_path')}: errors.{dtype}.{model}"
    table = _mapping(f"{ref.get('_path')}: errors", ref.get("errors"))
    entry = _mapping(where, _mapping(f"{ref.get('_path')}: errors.{dtype}", table.get(dtype, {})).get(model))
    return _replay_profile(f"{where}.replay", entry.get("replay"))


def _reference_errors(ref: Mapping[str, Any], dtype: str, models: Sequence[str]) -> dict[str, Any]:
    table = _mapping(f"{ref.get('_path')}: errors", ref.get("errors"))
    if dtype not in table:
        raise ParityCompareError(
            f"{ref.get('_path')}: no measured errors for dtype {dtype} (it has {', '.join(table)})"
        )
    per_model = _mapping(f"{ref.get('_path')}: errors.{dtype}", table[dtype])
    missing = [m for m in models if m not in per_model]
    if missing:
        raise ParityCompareError(f"{ref.get('_path')}: no measured errors for model {', '.join(missing)}")
    return {m: _profile(f"{ref.get('_path')}: errors.{dtype}.{m}", per_model[m]) for m in models}


def _judge(name: str, value: float, limit: float, detail: str, *, at_least: bool = False) -> Check:
    bad = not math.isfinite(value) or (value < limit if at_least else value > limit)
    sign = ">=" if at_least else "<="
    return Check(name, FAIL if bad else OK, f"{detail} {value:.3g} (allowed {sign} {limit:.3g})")


def _model_checks(model: str, s: Spread, tol: Mapping[str, Any] | None, values: ModelValues, mode: str):
    """(checks, per-point |d| / tolerance by depth, the shallowest point out of tolerance) of one model; ``tol``
    None: exact."""
    checks = _logprob_checks(model, s, tol) + _training_checks(model, s, tol) + _topk_checks(model, s, tol, mode)
    point_checks, ratios, first = _checksum_checks(model, s, tol, values, mode)
    return checks + point_checks, ratios, first


def _logprob_checks(model: str, s: Spread, tol: Mapping[str, Any] | None) -> list[Check]:
    def limit(key: str) -> float:
        return 0.0 if tol is None else tol[key]

    return [
        _judge(f"{model}.logprobs.mean", s.logprob_mean, limit("logprob_mean"), "mean |d log-prob| per token"),
        _judge(f"{model}.logprobs.max", s.logprob_max, limit("logprob_max"), "max |d log-prob| per token"),
        _judge(f"{model}.after-training.mean", s.after_logprob_mean, limit("after_logprob_mean"), "mean |d log-prob|"),
        _judge(f"{model}.after-training.max", s.after_logprob_max, limit("after_logprob_max"), "max |d log-prob|"),
    ]


def _training_checks(model: str, s: Spread, tol: Mapping[str, Any] | None) -> list[Check]:
    loss_tol = [0.0] * len(s.losses) if tol is None else tol["losses"]
    grad_tol = [0.0] * len(s.grad_norms) if tol is None else tol["grad_norms"]
    checks = [
        _judge(f"{model}.loss.step{i}", d, t, "|d loss|")
        for i, (d, t) in enumerate(zip(s.losses, loss_tol, strict=True))
    ]
    for i, (d, t) in enumerate(zip(s.grad_norms, grad_tol, strict=True)):
        checks.append(_judge(f"{model}.grad-norm.step{i}", d, t, "relative |d grad norm|"))
    return checks


def _topk_detail(agreed: Agreement | None, what: str) -> str:
    if agreed is None:
        return what
    rows = f"every one of {agreed.rows} query rows" if agreed.every_row else f"{agreed.rows} stored query rows"
    return f"{what} over {rows} (a random selection: {agreed.random:.3g})"


def _topk_checks(model: str, s: Spread, tol: Mapping[str, Any] | None, mode: str) -> list[Check]:
    checks = []
    for layer, value in s.topk_overlap.items():
        agreed = s.topk.get(layer)
        limit = 1.0 if tol is None else tol["topk_min_overlap"][layer]
        if agreed is not None and tol is not None:
            limit = topk_floor(limit, agreed.random)
        detail = _topk_detail(agreed, "overlap of the selected keys")
        checks.append(_judge(f"{model}.topk.{layer}", value, limit, detail, at_least=True))
    checks += [
        Check(f"{model}.topk.{layer}", FAIL, "the run recorded no top-k for this DSA layer") for layer in s.missing_topk
    ]
    status = FAIL if mode == "exact" else WARN
    checks += [
        Check(f"{model}.topk.{layer}", status, "a top-k the other run has not (another build?)")
        for layer in s.extra_topk
    ]
    return checks


def _ratio(difference: float, tolerance: float) -> float:
    if tolerance:
        return difference / tolerance
    return math.inf if difference else 0.0


def _indexer_layer(point: str) -> str | None:
    """``mbN/layers.L`` of an indexer q/k point (its top-k's key), else None."""
    name = point.partition("#")[0]
    for suffix in FUSED_INDEXER_POINTS:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _checksum_checks(model: str, s: Spread, tol: Mapping[str, Any] | None, values: ModelValues, mode: str):
    # a fused indexer (MindSpeed's, on Ascend) never materialises q and k: those points alone may be absent, where the
    # indexer's result, its layer's top-k, is judged over every query row instead (_topk_checks, with its floor)
    exempt = [
        p for p in s.missing_points if values.fused_indexer and mode != "exact"
        and (agreed := s.topk.get(_indexer_layer(p) or "")) is not None and agreed.every_row
    ]  # fmt: skip
    missing = [p for p in s.missing_points if p not in exempt]
    ratios: list[tuple[str, float]] = []
    bad: list[str] = []
    for point in sorted([*s.checksums, *missing], key=depth):  # by depth: the first fault is the shallowest
        if point in missing:
            ratios.append((point, math.inf))
            bad.append(point)
            continue
        limit = dict.fromkeys(STATISTICS, 0.0) if tol is None else tol["checksums"][point]
        ratio = max(_ratio(s.checksums[point][stat], limit[stat]) for stat in STATISTICS)
        ratios.append((point, ratio))
        if ratio > 1.0:
            bad.append(point)
    checks = [_missing_point(model, p, values) for p in missing]
    if exempt:
        layers = sorted({_indexer_layer(p) for p in exempt}, key=depth)
        detail = (f"this run's indexer ran inside MindSpeed's fused kernel (no q/k tensors): {len(layers)} layers' "
                  "indexers judged by their top-k over every query row (the topk checks)")  # fmt: skip
        checks.append(Check(f"{model}.checksum.indexer", OK, detail))
    if s.extra_points:
        shown = ", ".join(s.extra_points[:4]) + (" ..." if len(s.extra_points) > 4 else "")
        status = FAIL if mode == "exact" else WARN
        checks.append(
            Check(f"{model}.checksum.extra", status, f"{len(s.extra_points)} points the other run has not: {shown}")
        )
    if not bad:
        checks.append(Check(f"{model}.checksums", OK, f"{len(s.checksums)} points within tolerance"))
        return checks, ratios, None
    first = bad[0]
    differences = s.checksums.get(first)
    shown = ", ".join(f"|d {k}| {v:.3g}" for k, v in differences.items()) if differences else "absent"
    detail = f"first point out of tolerance: {first} ({shown}); every shallower point agrees"
    checks.append(Check(f"{model}.checksums", FAIL, detail, fix=_localise(first)))
    return checks, ratios, first


def _missing_point(model: str, point: str, values: ModelValues) -> Check:
    if values.fused_indexer and _indexer_layer(point):
        return Check(
            f"{model}.checksum.{point}",
            FAIL,
            "this run's fused indexer has no q/k tensors, and its layer's "
            "top-k was not recorded over every query row by both runs",
            fix="judge it against a run made by this version (its top-k records hold every query row)",
        )
    return Check(f"{model}.checksum.{point}", FAIL, "the run has no checksum at this point")


def _localise(point: str) -> str:
    """What the first failing point says about the fault."""
    name = point.partition("/")[2].partition("#")[0]
    if name.endswith(".indexer.k_norm"):
        return "the DSA indexer's key norm differs (its eps, its dtype or its weights)"
    if name.endswith(FUSED_INDEXER_POINTS):
        return "the indexer's query or key differ before the scores (a Hadamard rotation, RoPE layout, projection)"
    if name.endswith(".self_attention"):
        return "this layer's attention differs (its input norm, the top-k it attends over, the attention kernel)"
    if name.endswith(".mlp"):
        return "this layer's MLP/MoE differs (its norm, the router, the experts)"
    return "the values first differ here: look at the operator that produces this tensor"


# --- output -----------------------------------------------------------------------------------------------------------
PLOT_FORMATS = ("png", "svg", "pdf")


def plot(result: Comparison, path: str | Path, title: str) -> None:
    """Per model, each checksum point's largest |d| / tolerance by depth; 1.0 is the tolerance."""
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
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".").lower())
    plt.close(fig)
    atomic.write_bytes(path, buffer.getvalue())


def as_table_title(run: Mapping[str, Any], against: Mapping[str, Any], mode: str) -> str:
    return (f"verl-npu parity: {run.get('_path')} ({run.get('device')}, {run.get('dtype')}, path {run.get('path')}) "
            f"vs {against.get('_path')} ({against.get('device')}), mode {mode}")  # fmt: skip


# --- replay and one-step gradients (parity/replay.py, parity/gradients.py) ------------------------------------------
def replay_source_run(path: str | Path, dtype: str) -> dict[str, Any]:
    """The run a ``--replay-from`` file names: a run file itself, or a reference file's run of ``dtype``."""
    path = Path(path)
    try:
        data = loads_json(read_bytes(path, MAX_FILE_BYTES).decode("utf-8"))
    except NotReadable as exc:
        raise ParityCompareError(f"--replay-from {path}: cannot read it ({exc})") from None
    except (UnicodeDecodeError, ValueError, RecursionError, DuplicateKey) as exc:
        raise ParityCompareError(f"--replay-from {path}: not a JSON file ({exc})") from None
    kind = _mapping(str(path), data).get("kind")
    if kind not in (RUN_KIND, REFERENCE_KIND):
        raise ParityCompareError(f"--replay-from {path}: kind={kind!r}: expected a parity run or reference")
    data = {**data, "_path": str(path)}
    _kind_and_format(str(path), data, kind)
    return reference_run(data, dtype) if kind == REFERENCE_KIND else data


def has_replay(run: Mapping[str, Any], model: str) -> bool:
    """Whether ``run`` recorded ``model``'s block-boundary tensors (a model with ``replay`` off has none)."""
    m = _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model)
    evaluation = m.get("eval") if isinstance(m, Mapping) else None
    return isinstance(evaluation, Mapping) and evaluation.get("replay") is not None


def natural_tensors(run: Mapping[str, Any], model: str) -> Mapping[str, Any]:
    """A run's recorded block-boundary tensors of ``model`` (point -> stored tensor), non-empty."""
    where = f"{run.get('_path', 'run')}: models.{model}"
    m = _mapping(where, _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model))
    replay = _mapping(f"{where}.eval.replay", _mapping(f"{where}.eval", m.get("eval")).get("replay"))
    natural = _mapping(f"{where}.eval.replay.natural", replay.get("natural"))
    if not natural:
        raise ParityCompareError(f"{where}.eval.replay.natural: empty: the run recorded no block-boundary tensors")
    return natural


class Source:
    """The natural tensors a run's blocks are fed for one model, and where they came from (recorded with the run)."""

    def __init__(self, tensors: dict[str, torch.Tensor], identity: dict[str, Any]):
        self.tensors = tensors
        self.identity = identity


def source_of(path: str, model: str, dtype: str) -> Source:
    """``model``'s natural tensors in a run file, or in a reference file's run of ``dtype``. A file that is neither,
    or holds no such tensors, is a UserError naming it (exit 2, before the device starts)."""
    from verl_npu.parity.replay import decode, digest

    run = replay_source_run(path, dtype)
    natural = natural_tensors(run, model)
    tensors = {
        point: decode(f"{run['_path']}: models.{model}.eval.replay.natural.{point}", record)
        for point, record in natural.items()
    }
    identity = {
        "path": run["_path"],
        "device": run.get("device"),
        "dtype": run_dtype(run),
        "digest": digest(natural),
    }
    return Source(tensors, identity)


def _replayed(run: Mapping[str, Any], model: str) -> Mapping[str, Any] | None:
    where = f"{run.get('_path', 'run')}: models.{model}.eval.replay"
    m = _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model)
    replay = _mapping(where, _mapping(f"{where}", _mapping("eval", _mapping("model", m).get("eval")).get("replay")))
    value = replay.get("replayed")
    return None if value is None else _mapping(f"{where}.replayed", value)


def _decode_all(where: str, records: Mapping[str, Any]) -> dict[str, Any]:
    from verl_npu.parity.replay import ReplayError, decode

    try:
        return {p: decode(f"{where}.{p}", r) for p, r in _mapping(where, records).items()}
    except ReplayError as exc:
        raise ParityCompareError(str(exc)) from None


# a block's difference relative to its output, in L2 norm: a statistic of thousands of elements, which the triangle
# inequality bounds as it bounds each; a largest element is one sample, and a correct platform's worst element is
# as often worse than the reference's as better (measured: CPU against nvidia-h200, fp32, up to 1.3x)
BLOCK_METRICS = ("rel_l2",)


def _relative(x: Any, r: Any) -> dict[str, float]:
    """How far ``x`` is from ``r`` relative to ``r``, in L2 norm."""
    import torch

    d = x.double() - r.double()
    return {"rel_l2": float(torch.linalg.vector_norm(d)) / max(float(torch.linalg.vector_norm(r.double())), 1e-300)}


@dataclasses.dataclass(frozen=True)
class ReplaySpread:
    """How a replayed run's blocks differ from its source's (each block fed the source's own input)."""

    blocks: dict[str, dict[str, float]]  # point (mbN/layers.N.self_attention | .mlp) -> rel_l2, max
    logprob_max: float
    logprob_mean: float
    topk_overlap: dict[str, float]
    missing_topk: list[str]  # DSA layers whose top-k the source recorded and the replay did not
    extra_topk: list[str]
    gradients: dict[str, float]  # group -> relative difference of the gradient probes' sketches
    updates: dict[str, float]  # group -> step 0's update against AdamW's from the same gradients (the run's own)
    topk: dict[str, Agreement] = dataclasses.field(default_factory=dict)  # layer -> how it was measured


def replay_spread(run: Mapping[str, Any], source: Mapping[str, Any], model: str) -> ReplaySpread:
    """``run``'s replayed blocks against ``source``'s own (``run`` must have been fed ``source``: its recorded
    source digest must be that of ``source``'s natural tensors), and its step-0 gradients and update against
    ``source``'s. Raises ParityCompareError for a run that was not replayed from ``source``."""
    from verl_npu.parity.replay import ReplayError, contributions, digest

    where = f"{run.get('_path', 'run')}: models.{model}"
    replayed = _replayed(run, model)
    natural = natural_tensors(source, model)
    if replayed is None:
        raise ParityCompareError(f"{where}: the run was not replayed (make it with --replay-from "
                                 f"{source.get('_path')})")  # fmt: skip
    identity = _mapping(f"{where}.eval.replay.replayed.source", replayed.get("source"))
    if identity.get("digest") != digest(natural):
        raise ParityCompareError(
            f"{where}: replayed from {identity.get('path')}, not from {source.get('_path')} (their natural tensors "
            "differ): remake the run with --replay-from the latter"
        )
    try:
        expected = contributions(_decode_all(f"{source.get('_path')}: models.{model}.eval.replay.natural", natural))
    except ReplayError as exc:
        raise ParityCompareError(f"{source.get('_path')}: {exc}") from None
    outputs = _decode_all(f"{where}.eval.replay.replayed.outputs", replayed.get("outputs"))
    missing = sorted(set(expected) - set(outputs))
    if missing:
        raise ParityCompareError(f"{where}: the replay has no {', '.join(missing[:4])}: a block did not run")
    blocks = {p: _relative(outputs[p], expected[p]) for p in sorted(expected, key=depth)}
    ours = _logprobs(f"{where}.eval.replay.replayed.logprobs", [row for mb in _list(
        f"{where}.eval.replay.replayed.logprobs", replayed.get("logprobs")) for row in _list("mb", mb)])  # fmt: skip
    theirs = model_values(source, model).logprobs
    _same_shape("replayed log-probs", ours, theirs)
    d = [abs(x - y) for x, y in zip(_flat(ours), _flat(theirs), strict=True)]
    topk = _topk(f"{where}.eval.replay.replayed.topk", replayed.get("topk", {}))
    source_topk = model_values(source, model).topk
    try:
        agreed = {layer: agreement(topk[layer], b) for layer, b in source_topk.items() if layer in topk}
    except ValueError as exc:
        raise ParityCompareError(
            f"{where}.eval.replay.replayed.topk: not comparable with the source's: {exc}"
        ) from None
    return ReplaySpread(
        blocks=blocks,
        logprob_max=max(d),
        logprob_mean=sum(d) / len(d),
        topk_overlap={layer: a.overlap for layer, a in agreed.items()},
        missing_topk=sorted(set(source_topk) - set(topk), key=depth),
        extra_topk=sorted(set(topk) - set(source_topk), key=depth),
        gradients=_relative_sketches(  # both at the source's activations: the source's own probe is its natural one
            f"{where}.train.gradients",
            _train_sketches(run, model, "gradients"),
            _train_sketches(source, model, "gradients_natural"),
        ),
        updates=update_residuals(run, model),
        topk=agreed,
    )


def update_residuals(run: Mapping[str, Any], model: str) -> dict[str, float]:
    """Per group, how far the run's step-0 update is from AdamW's on the host from the same gradients (relative);
    empty for a bf16 run (its weights round away an update of the learning rate's size)."""
    if run_dtype(run) == "bf16":
        return {}
    where = f"{run.get('_path', 'run')}: models.{model}.train.update"
    m = _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model)
    update = _mapping(where, _mapping("train", _mapping("model", m).get("train")).get("update"))
    actual = _sketches(_mapping(f"{where}.actual", update.get("actual")), f"{where}.actual")
    expected = _sketches(_mapping(f"{where}.expected", update.get("expected")), f"{where}.expected")
    return _relative_sketches(where, actual, expected)


def _sketches(groups: Mapping[str, Any], where: str) -> dict[str, list[float]]:
    out = {}
    for group, entry in groups.items():
        sketch = _series(f"{where}.{group}.sketch", _mapping(f"{where}.{group}", entry).get("sketch"))
        out[group] = sketch
    if not out:
        raise ParityCompareError(f"{where}: empty: nothing to compare")
    return out


def _train_sketches(run: Mapping[str, Any], model: str, key: str) -> dict[str, list[float]]:
    where = f"{run.get('_path', 'run')}: models.{model}.train.{key}"
    m = _mapping(f"{run.get('_path', 'run')}: models", run.get("models")).get(model)
    return _sketches(_mapping(where, _mapping("train", _mapping("model", m).get("train")).get(key)), where)


def _relative_sketches(where: str, ours: Mapping[str, list[float]], theirs: Mapping[str, list[float]]):
    """Per group, |ours - theirs| / |theirs| of two sketches of the same groups."""
    if set(ours) != set(theirs):
        raise ParityCompareError(f"{where}: groups {sorted(ours)[:6]} against {sorted(theirs)[:6]}")
    out = {}
    for group, r in theirs.items():
        x = ours[group]
        if len(x) != len(r):
            raise ParityCompareError(f"{where}.{group}: sketches of {len(x)} and {len(r)} values")
        scale = math.sqrt(math.fsum(v * v for v in r))
        out[group] = math.sqrt(math.fsum((a - b) ** 2 for a, b in zip(x, r, strict=True))) / max(scale, 1e-300)
    return out


def replay_errors(spread_: ReplaySpread) -> dict[str, Any]:
    """A replay spread as the measured-error profile a reference records (``errors[dtype][model]["replay"]``)."""
    return {
        "blocks": spread_.blocks,
        "logprob_max": spread_.logprob_max,
        "logprob_mean": spread_.logprob_mean,
        "topk_disagreement": {layer: 1.0 - v for layer, v in spread_.topk_overlap.items()},
        "gradients": spread_.gradients,
        "updates": spread_.updates,
    }


def _replay_profile(where: str, value: Any) -> dict[str, Any]:
    e = _mapping(where, value)

    def number(key: str, v: Any) -> float:
        return _error_value(f"{where}.{key}", v)

    return {
        "blocks": {p: {k: number(f"blocks.{p}.{k}", _mapping(f"{where}.blocks.{p}", v).get(k)) for k in BLOCK_METRICS}
                   for p, v in _mapping(f"{where}.blocks", e.get("blocks")).items()},
        "logprob_max": number("logprob_max", e.get("logprob_max")),
        "logprob_mean": number("logprob_mean", e.get("logprob_mean")),
        "topk_disagreement": {k: number(f"topk_disagreement.{k}", v)
                              for k, v in _mapping(f"{where}.topk_disagreement", e.get("topk_disagreement")).items()},
        **{key: {k: number(f"{key}.{k}", v) for k, v in _mapping(f"{where}.{key}", e.get(key)).items()}
           for key in ("gradients", "updates")},
    }  # fmt: skip


def replay_checks(model: str, s: ReplaySpread, measured: Mapping[str, Any], dtype: str, label: str):
    """(checks, per-block |d| / tolerance by depth, the first block out of tolerance) of one replayed model: each
    tolerance TRIANGLE x the reference's measured error of that block (or group, or layer), at least the unit
    roundoff of ``dtype``."""
    u = UNIT_ROUNDOFF[dtype]
    checks: list[Check] = []
    ratios: list[tuple[str, float]] = []
    bad: list[str] = []
    blocks = measured["blocks"]
    for point, values in s.blocks.items():
        if point not in blocks:
            checks.append(Check(f"{model}.{label}.{point}", FAIL, "the reference measured no error for this block"))
            bad.append(point)
            continue
        limit = {k: max(TRIANGLE * blocks[point][k], u) for k in BLOCK_METRICS}
        ratio = max(_ratio(values[k], limit[k]) for k in limit)
        ratios.append((point, ratio))
        if ratio > 1.0 or not math.isfinite(ratio):
            bad.append(point)
            shown = ", ".join(f"{k} {values[k]:.3g} (allowed <= {limit[k]:.3g})" for k in limit)
            detail = f"fed the source's input, this block differs: {shown}"
            checks.append(Check(f"{model}.{label}.{point}", FAIL, detail, fix=_localise(point)))
    scale = u * 64.0
    checks.append(_judge(f"{model}.{label}.logprobs.max", s.logprob_max, max(TRIANGLE * measured["logprob_max"], scale),
                         "final norm + output layer on the source's last hidden state: max |d log-prob|"))  # fmt: skip
    checks.append(_judge(f"{model}.{label}.logprobs.mean", s.logprob_mean,
                         max(TRIANGLE * measured["logprob_mean"], scale), "mean |d log-prob|"))  # fmt: skip
    for layer, value in s.topk_overlap.items():
        disagreement = measured["topk_disagreement"].get(layer)
        if disagreement is None:
            checks.append(Check(f"{model}.{label}.topk.{layer}", FAIL, "the reference measured no top-k error here"))
            continue
        agreed = s.topk.get(layer)
        limit = max(0.0, 1.0 - TRIANGLE * disagreement)
        limit = limit if agreed is None else topk_floor(limit, agreed.random)
        detail = _topk_detail(agreed, "fed the source's input, overlap of the selected keys")
        checks.append(_judge(f"{model}.{label}.topk.{layer}", value, limit, detail, at_least=True))
    for layer in s.missing_topk:
        checks.append(Check(f"{model}.{label}.topk.{layer}", FAIL, "the source's DSA layer recorded a top-k here, the "
                            "replay none (the layer did not select or reuse one)"))  # fmt: skip
        bad.append(layer)
    for layer in s.extra_topk:
        checks.append(Check(f"{model}.{label}.topk.{layer}", FAIL, "a top-k the source's layer has not"))
        bad.append(layer)
    for key in ("gradients", "updates"):
        for group, value in getattr(s, key).items():
            limit = measured[key].get(group)
            if limit is None:
                checks.append(Check(f"{model}.{label}.{key}.{group}", FAIL, "the reference measured no error here"))
                continue
            what = "gradient probe" if key == "gradients" else "step 0's update against AdamW's from its gradients"
            if key == "gradients" and dtype != "bf16":
                limit *= GRADIENT_REDUCTION_ORDER
            checks.append(_judge(f"{model}.{label}.{key}.{group}", value, max(TRIANGLE * limit, u),
                                 f"{what}, relative |d sketch| of this group"))  # fmt: skip
    first = next((p for p in sorted(bad, key=depth)), None)
    if first is None:
        checks.append(Check(f"{model}.{label}", OK, f"{len(s.blocks)} blocks within tolerance, each fed the "
                                                    "source's input"))  # fmt: skip
    else:
        checks.append(Check(f"{model}.{label}", FAIL, f"first block out of tolerance, fed the source's input: {first}",
                            fix=_localise(first)))  # fmt: skip
    return checks, ratios, first
