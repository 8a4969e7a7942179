"""The nightly GLM-5 jobs' step-1 guard: verl's rollout-vs-actor probability difference at step 1, computed by verl's
own metric code and written by verl's own loggers, against the bound in ci/baselines/dsa_glm5_small.json."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import REPO

from verl_npu.ci.compare import DEFAULT_GUARDS, PROBS_DIFF_MEAN, CompareError, compare, read_baseline

BASELINES = [REPO / "ci" / "baselines" / f"{job}.json" for job in ("dsa_glm5_small", "multinode_grpo")]
JOBS = REPO / "ci" / "nightly" / "jobs"


def rollout_vs_actor(garbage: bool, seed: int) -> dict:
    """verl's calculate_debug_metrics on 8 responses of 64 tokens: the actor's log-probs of the sampled tokens, and
    the rollout's, either the same model up to bf16 noise or one that reads garbage weights (it samples tokens it
    is sure of, which the actor is not)."""
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    generator = torch.Generator().manual_seed(seed)
    actor = torch.log(torch.rand(8, 64, generator=generator) * 0.9 + 0.05)
    if garbage:
        rollout = torch.log(torch.full_like(actor, 0.99))
    else:
        rollout = (actor.exp() + 1e-3 * torch.randn(8, 64, generator=generator)).clamp(1e-6, 1).log()
    tensors = {"rollout_log_probs": rollout, "old_log_probs": actor}
    tensors |= {"responses": torch.zeros(8, 64).long(), "response_mask": torch.ones(8, 64)}
    batch = DataProto.from_dict(tensors=tensors)
    return calculate_debug_metrics(batch)


def write_log(tmp_path: Path, monkeypatch, garbage_at_step: int | None) -> Path:
    """A console log written by verl's Tracking (prefixed as Ray prints it), 15 steps of the nightly's metrics."""
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        tracker = Tracking("ci", "job", default_backend=["console"])
        for step in range(1, 16):
            metrics = {"perf/throughput": 1000.0, "timing_s/step": 60.0, "critic/rewards/mean": 0.1,
                       "perf/max_memory_allocated_gb": 30.0}  # fmt: skip
            tracker.log(metrics | rollout_vs_actor(garbage=step == garbage_at_step, seed=step), step=step)
    log = tmp_path / "train.log"
    log.write_text("".join(f"(TaskRunner pid=7) {line}\n" for line in console.getvalue().splitlines()))
    return log


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "verl_npu.cli", "ci", *args], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("baseline", BASELINES, ids=lambda p: p.stem)
def test_the_glm5_jobs_guard_the_rollout_vs_actor_difference_at_step_1(baseline):
    (guard,) = read_baseline(baseline).guards
    assert (guard.metric, guard.step, guard.minimum, guard.maximum) == (PROBS_DIFF_MEAN, 1, None, 0.05)
    assert DEFAULT_GUARDS == {PROBS_DIFF_MEAN: {"step": 1, "max": 0.05}}  # what --update gives a new baseline


def test_a_right_sync_passes_the_guard_on_the_first_night(tmp_path, monkeypatch):
    log = write_log(tmp_path, monkeypatch, garbage_at_step=None)
    assert "(TaskRunner pid=7) step:1 - perf/throughput:1000.0 - " in log.read_text()
    # the baseline's values are not taken yet (a job's first nights): the guard still ran, and passed
    with pytest.raises(CompareError, match=r"no values taken yet .*its guards passed: "
                                           r"training/rollout_probs_diff_mean \(step 1\)"):  # fmt: skip
        compare(log, read_baseline(BASELINES[0]))
    done = cli("compare", str(log), str(BASELINES[0]))
    assert done.returncode == 2 and "its guards passed" in done.stderr


def test_a_rollout_reading_garbage_weights_fails_the_first_night(tmp_path, monkeypatch):
    log = write_log(tmp_path, monkeypatch, garbage_at_step=1)
    (row,) = compare(log, read_baseline(BASELINES[0]))
    assert row.metric == "training/rollout_probs_diff_mean (step 1)" and row.verdict == "regression"
    assert row.current > 0.3 and row.limit == "<= 0.05 at step 1"
    done = cli("compare", str(log), str(BASELINES[0]), "--json", str(tmp_path / "out.json"))
    assert done.returncode == 1 and "REGRESSION" in done.stdout
    assert json.loads((tmp_path / "out.json").read_text())["regressions"] == 1
    # only step 1 is guarded: the same difference later (training moves the actor) is the window's business
    (tmp_path / "later").mkdir()
    later = write_log(tmp_path / "later", monkeypatch, garbage_at_step=7)
    with pytest.raises(CompareError, match="its guards passed"):
        compare(later, read_baseline(BASELINES[0]))


def test_a_guard_with_taken_values_runs_next_to_the_window(tmp_path, monkeypatch):
    baseline = tmp_path / "job.json"
    shutil.copy(BASELINES[0], baseline)
    data = json.loads(baseline.read_text())
    good = write_log(tmp_path, monkeypatch, garbage_at_step=None)
    for metric in data["metrics"]:
        data["metrics"][metric]["value"] = None
    baseline.write_text(json.dumps(data))
    assert cli("compare", str(good), str(baseline), "--update").returncode == 0
    assert json.loads(baseline.read_text())["guards"] == data["guards"]  # --update keeps the guards
    rows = compare(good, read_baseline(baseline))
    assert rows[0].metric == "training/rollout_probs_diff_mean (step 1)"
    assert {r.verdict for r in rows} == {"ok"} and len(rows) == 1 + len(data["metrics"])


def test_an_unmeasured_guard_fails_closed_and_a_malformed_one_is_named(tmp_path, monkeypatch):
    log = tmp_path / "train.log"
    log.write_text("step:1 - perf/throughput:1000.0\nstep:2 - perf/throughput:1000.0\n")
    with pytest.raises(CompareError, match=r"calculate_log_probs=True"):
        compare(log, read_baseline(BASELINES[0]))
    log.write_text(f"step:1 - {PROBS_DIFF_MEAN}:nan\n")
    with pytest.raises(CompareError, match=r"is nan at step 1"):
        compare(log, read_baseline(BASELINES[0]))
    bad = tmp_path / "bad.json"
    data = json.loads(BASELINES[0].read_text())
    data["guards"][PROBS_DIFF_MEAN] = {"step": 1, "max": 0.05, "maximum": 0.1}
    bad.write_text(json.dumps(data))
    with pytest.raises(CompareError, match=r"guards.training/rollout_probs_diff_mean: unknown keys \['maximum'\]"):
        read_baseline(bad)
    data["guards"][PROBS_DIFF_MEAN] = {"step": 1, "min": 0.5, "max": 0.05}
    bad.write_text(json.dumps(data))
    with pytest.raises(CompareError, match=r"min 0\.5 is above max 0\.05"):
        read_baseline(bad)


@pytest.mark.parametrize("job", ["dsa_glm5_small", "dense_grpo_offload", "ckpt_resume_offload"])
def test_jobs_whose_baselines_hold_the_rollout_metric_log_it(job):
    """verl logs training/rollout_probs_diff_* only with calculate_log_probs=True (verl/trainer/ppo/v1)."""
    assert "actor_rollout_ref.rollout.calculate_log_probs=True" in (JOBS / f"{job}.sh").read_text()
    assert PROBS_DIFF_MEAN in json.loads((REPO / "ci" / "baselines" / f"{job}.json").read_text())["metrics"]
