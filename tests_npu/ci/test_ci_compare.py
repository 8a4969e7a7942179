"""`verl-npu ci compare` on logs written by verl's own metric logging code (console and file loggers)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.paths import REPO

from verl_npu.ci.compare import CompareError, compare, read_baseline, read_log

BASE = {
    "perf/max_memory_allocated_gb": 30.0,
    "perf/throughput": 1000.0,
    "timing_s/step": 60.0,
    "critic/rewards/mean": 0.5,
    "training/rollout_probs_diff_mean": 0.02,
}


def metrics(step: int, **changes: float) -> dict:
    """One step's metrics with small step-to-step noise, as numpy scalars like verl's reducers give."""
    wobble = 1 + 0.01 * ((step % 3) - 1)
    values = {k: changes.get(k.replace("/", "_"), v) * wobble for k, v in BASE.items()}
    return {k: np.float64(v) for k, v in values.items()} | {
        "actor/pg_loss": np.float32(0.1),
        "training/global_step": step,
    }


def write_logs(tmp_path: Path, steps: int = 15, monkeypatch=None, **changes: float) -> tuple[Path, Path]:
    """(console log, file-logger JSONL) written by verl.utils.tracking.Tracking."""
    from verl.utils.tracking import Tracking

    jsonl = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(jsonl))
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        tracker = Tracking("ci", "job", default_backend=["console", "file"])
        for step in range(1, steps + 1):
            tracker.log(metrics(step, **changes), step=step)
        tracker.logger["file"].finish()
    log = tmp_path / "train.log"
    # Ray prefixes driver-side prints with the actor that printed them
    log.write_text("\n".join(f"(TaskRunner pid=4242) {line}" for line in console.getvalue().splitlines()) + "\n")
    return log, jsonl


def baseline_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.json"
    shutil.copy(REPO / "ci" / "baselines" / "dense_grpo_offload.json", path)
    data = json.loads(path.read_text())
    for metric, value in BASE.items():
        data["metrics"][metric]["value"] = value
    path.write_text(json.dumps(data))
    return path


def verdicts(log: Path, baseline: Path) -> dict[str, str]:
    return {row.metric: row.verdict for row in compare(log, read_baseline(baseline))}


def test_both_log_formats_parse_to_the_same_steps(tmp_path, monkeypatch):
    log, jsonl = write_logs(tmp_path, monkeypatch=monkeypatch)
    console, file = read_log(log), read_log(jsonl)
    assert sorted(console) == sorted(file) == list(range(1, 16))
    for step in console:
        for key in BASE:
            assert console[step][key] == pytest.approx(file[step][key])


def test_an_unchanged_run_passes(tmp_path, monkeypatch):
    log, jsonl = write_logs(tmp_path, monkeypatch=monkeypatch)
    baseline = baseline_file(tmp_path)
    assert set(verdicts(log, baseline).values()) == {"ok"}
    assert set(verdicts(jsonl, baseline).values()) == {"ok"}


@pytest.mark.parametrize(
    ("change", "metric"),
    [
        ({"perf_max_memory_allocated_gb": 31.2}, "perf/max_memory_allocated_gb"),  # +1.2 GB > +1 GB
        ({"perf_throughput": 940.0}, "perf/throughput"),  # -6% < -5%
        ({"timing_s_step": 63.6}, "timing_s/step"),  # +6% > +5%
        ({"critic_rewards_mean": 0.44}, "critic/rewards/mean"),  # -0.06 outside +-0.05
        ({"critic_rewards_mean": 0.56}, "critic/rewards/mean"),  # +0.06 outside +-0.05
        ({"training_rollout_probs_diff_mean": 0.0212}, "training/rollout_probs_diff_mean"),  # +6%
    ],
)
def test_each_kind_of_regression_is_caught_and_only_that_metric_fails(tmp_path, monkeypatch, change, metric):
    log, _ = write_logs(tmp_path, monkeypatch=monkeypatch, **change)
    result = verdicts(log, baseline_file(tmp_path))
    assert result[metric] == "regression"
    assert all(v == "ok" for k, v in result.items() if k != metric)


def test_changes_within_the_limits_pass(tmp_path, monkeypatch):
    log, _ = write_logs(
        tmp_path, monkeypatch=monkeypatch, perf_throughput=960.0, perf_max_memory_allocated_gb=30.9,
        critic_rewards_mean=0.46,
    )  # fmt: skip
    assert set(verdicts(log, baseline_file(tmp_path)).values()) == {"ok"}


def test_truncated_malformed_missing_and_short_logs_give_clear_errors(tmp_path, monkeypatch):
    log, jsonl = write_logs(tmp_path, monkeypatch=monkeypatch)
    baseline = read_baseline(baseline_file(tmp_path))
    lines = log.read_text().splitlines()

    truncated = tmp_path / "truncated.log"
    truncated.write_text("\n".join([*lines[:-1], lines[-1][: len(lines[-1]) // 2]]))
    with pytest.raises(CompareError, match=rf"truncated.log:{len(lines)}: truncated"):
        compare(truncated, baseline)

    cut_json = tmp_path / "cut.jsonl"
    cut_json.write_text(jsonl.read_text()[:-40])
    with pytest.raises(CompareError, match=r"cut.jsonl:15: truncated"):
        compare(cut_json, baseline)

    malformed = tmp_path / "malformed.log"
    malformed.write_text("\n".join([*lines[:3], lines[3].replace("perf/throughput:", "perf/throughput "), *lines[4:]]))
    with pytest.raises(CompareError, match=r"malformed.log:4: malformed: cannot read 'perf/throughput"):
        compare(malformed, baseline)

    missing = tmp_path / "missing.log"
    missing.write_text("\n".join(line.replace(" - timing_s/step:", " - timing_s/other:") for line in lines))
    with pytest.raises(CompareError, match=r"metric 'timing_s/step' is missing at steps \[5, 6"):
        compare(missing, baseline)

    (tmp_path / "short").mkdir()
    short, _ = write_logs(tmp_path / "short", 10, monkeypatch)
    with pytest.raises(CompareError, match=r"the window needs steps 5-14 and the log has steps 1..10"):
        compare(short, baseline)

    empty = tmp_path / "empty.log"
    empty.write_text("Ray started\nno metrics here\n")
    with pytest.raises(CompareError, match="no per-step metric lines"):
        compare(empty, baseline)


def test_a_pending_baseline_says_how_to_take_it(tmp_path, monkeypatch):
    log, _ = write_logs(tmp_path, monkeypatch=monkeypatch)
    with pytest.raises(CompareError, match=r"no values taken yet .* --update"):
        compare(log, read_baseline(REPO / "ci" / "baselines" / "dense_grpo_offload.json"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("window"), "missing top-level key 'window'"),
        (lambda d: d["metrics"]["timing_s/step"]["limit"].update(kind="percent"), "needs kind = absolute or relative"),
        (lambda d: d["metrics"]["timing_s/step"]["limit"].update(max_increse=0.1), "unknown keys \\['max_increse'\\]"),
        (
            lambda d: d["metrics"]["timing_s/step"].update(value="fast"),
            "metrics.timing_s/step.value='fast': expected a JSON number",
        ),
    ],
)
def test_malformed_baselines_name_the_key(tmp_path, edit, message):
    path = baseline_file(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(CompareError, match=message):
        read_baseline(path)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "verl_npu.cli", "ci", *args], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def test_cli_update_then_compare_table_json_and_exit_codes(tmp_path, monkeypatch):
    good, _ = write_logs(tmp_path, monkeypatch=monkeypatch)
    baseline = tmp_path / "job.json"
    shutil.copy(REPO / "ci" / "baselines" / "dense_grpo_offload.json", baseline)
    done = cli("compare", str(good), str(baseline), "--update", "--image", "img:a2-x", "--commit", "abc")
    assert done.returncode == 0, done.stderr
    taken = json.loads(baseline.read_text())
    assert taken["image"] == "img:a2-x" and taken["commit"] == "abc"
    assert taken["metrics"]["perf/throughput"]["value"] == pytest.approx(1000.0, rel=0.01)

    done = cli("compare", str(good), str(baseline), "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "perf/throughput" in done.stdout and "ok" in done.stdout
    assert json.loads((tmp_path / "out.json").read_text())["regressions"] == 0

    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    slow, _ = write_logs(slow_dir, monkeypatch=monkeypatch, timing_s_step=70.0)
    done = cli("compare", str(slow), str(baseline))
    assert done.returncode == 1 and "REGRESSION" in done.stdout
    done = cli("compare", str(tmp_path / "absent.log"), str(baseline))
    assert done.returncode == 2 and "absent.log: no such log file" in done.stderr
