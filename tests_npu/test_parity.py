"""Platform parity (issue 19): the parity job on the CPU against the CUDA reference, and the five upstream mismatches
injected into the engine (tests_npu/support/parity_injections.py), each caught and localised to its layer.

The CPU runs are separate processes (the job sets deterministic mode and the process group for its whole process),
through the same entry point as ``verl-npu parity run``. The reference is ci/baselines/parity/reference.json,
recorded on nvidia-h200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mbridge", reason="the parity job builds through mbridge; not installed here")

from verl_npu.parity import compare as cmp
from verl_npu.parity.cli import DEFAULT_REFERENCE
from verl_npu.parity.job import RUN_KIND

REPO = Path(__file__).resolve().parent.parent
INJECT = REPO / "tests_npu" / "support" / "parity_injections.py"
CPU_MODELS = ("glm5_2", "dense")


def run_job(out: Path, dtype: str, inject: str = "none", models=CPU_MODELS) -> dict:
    argv = [sys.executable, str(INJECT), "--inject", inject, "--dtype", dtype, "--out", str(out)]
    for model in models:
        argv += ["--model", model]
    env = {**os.environ, "VERL_NPU_PLATFORM": "cpu", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return cmp.load(out, RUN_KIND)


@pytest.fixture(scope="module")
def reference():
    return cmp.load(DEFAULT_REFERENCE, cmp.REFERENCE_KIND)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def clean_fp32(workdir):
    return run_job(workdir / "clean_fp32.json", "fp32")


@pytest.fixture(scope="module")
def clean_fp64(workdir):
    return run_job(workdir / "clean_fp64.json", "fp64")


@pytest.fixture(scope="module")
def clean_bf16(workdir):
    return run_job(workdir / "clean_bf16.json", "bf16", models=("glm5_2",))


def test_the_reference_is_an_nvidia_h200_run_with_derived_tolerances(reference):
    assert "H200" in reference["device"]
    assert set(reference["runs"]) == {"bf16", "fp32", "fp64"} and set(reference["tolerances"]) == {"bf16", "fp32"}
    assert "2 x the reference's measured error" in reference["derivation"]
    for dtype in ("bf16", "fp32"):
        assert reference["runs"][dtype]["dtype"] == dtype and reference["runs"][dtype]["platform"] == "cuda"
        assert set(reference["runs"][dtype]["models"]) >= {"glm5_2", "dense", "glm5_2_fused_shape"}
        for model, spreads in reference["measured_spreads"][dtype].items():
            assert set(spreads) == {cmp.PRECISE[dtype], "repeat"}, model


def test_a_cpu_run_passes_the_reference_in_fp32(clean_fp32, clean_fp64, reference):
    """With the CPU's own fp32 error measured (its fp64 run), |CPU - H200| <= CPU's error + H200's error + the
    distance between the two fp64 runs: the bound is the triangle inequality, every term measured."""
    result = cmp.compare(
        clean_fp32, cmp.reference_run(reference, "fp32"), reference, models=CPU_MODELS, precise=clean_fp64
    )
    failures = [c for c in result.checks if c.status == "fail"]
    assert not failures, failures[:10]
    assert result.first_fault == {"glm5_2": None, "dense": None}


def test_precise_must_be_the_wider_dtype_from_the_same_platform(clean_fp32, clean_bf16, reference):
    with pytest.raises(cmp.ParityCompareError, match="measured against fp64"):
        cmp.compare(clean_fp32, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",), precise=clean_bf16)
    elsewhere = {**cmp.reference_run(reference, "fp64"), "_path": "h200-fp64"}
    with pytest.raises(cmp.ParityCompareError, match="measured on its own platform"):
        cmp.compare(clean_fp32, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",), precise=elsewhere)


def test_the_same_build_twice_is_bitwise_equal_on_the_cpu(clean_fp32, workdir, reference):
    again = run_job(workdir / "again_fp32.json", "fp32")
    assert not cmp.compare(again, clean_fp32, reference, "exact").failed


# injection -> (dtype, mode against the clean CPU run, the first point out of tolerance, the checks that must fail).
# The clean CPU run is the same engine without the mismatch: every point before the fault is bitwise the same, so
# the first fault is the mismatch's, whatever the CPU's own accuracy. Against the CUDA reference the run fails too,
# except norm_upcast: one extra bf16 rounding is within bf16's own error there, which is what the exact mode is for.
INJECTED = {
    "k_norm_eps": ("fp32", "pair", "mb0/layers.0.indexer.k_norm", ["glm5_2.topk.mb0/layers.0"]),
    "shared_own_topk": ("fp32", "pair", "mb0/layers.3.self_attention", ["glm5_2.topk.mb0/layers.3"]),
    "topk_leak": ("fp32", "pair", "mb1/layers.3.self_attention", []),
    "hadamard": ("bf16", "pair", "mb0/layers.0.indexer.q", []),
    "norm_upcast": ("bf16", "exact", "mb0/layers.2.indexer.k_norm", []),  # the first reader of the norm
}


@pytest.mark.parametrize("injection", sorted(INJECTED))
def test_an_injected_mismatch_fails_and_names_its_layer(injection, workdir, reference, clean_fp32, clean_bf16):
    dtype, mode, first, failing = INJECTED[injection]
    run = run_job(workdir / f"{injection}.json", dtype, injection, models=("glm5_2",))
    against_cuda = cmp.compare(run, cmp.reference_run(reference, dtype), reference, models=("glm5_2",))
    assert against_cuda.failed or injection == "norm_upcast"
    against = clean_fp32 if dtype == "fp32" else clean_bf16
    result = cmp.compare(run, against, reference, mode, models=("glm5_2",))
    assert result.failed
    assert result.first_fault["glm5_2"] == first
    failed = {c.check for c in result.checks if c.status == "fail"}
    assert set(failing) <= failed, sorted(failed)
    # every point before the fault agrees: localised, not merely different
    order = [p for p, _ in result.layer_differences["glm5_2"]]
    before = order[: order.index(first)]
    assert all(ratio <= 1.0 for point, ratio in result.layer_differences["glm5_2"] if point in before)


def test_the_cli_compares_writes_json_and_a_plot_and_exits_by_verdict(clean_fp32, clean_fp64, workdir, tmp_path):
    from verl_npu.cli import main

    run = workdir / "clean_fp32.json"
    report, picture = tmp_path / "report.json", tmp_path / "layers.png"
    argv = [
        "parity",
        "compare",
        str(run),
        "--model",
        "glm5_2",
        "--model",
        "dense",
        "--precise",
        str(workdir / "clean_fp64.json"),
    ]
    assert main([*argv, "--json", str(report), "--plot", str(picture)]) == 0
    data = json.loads(report.read_text())
    assert data["verdict"] == "ok" and data["mode"] == "reference" and picture.stat().st_size > 1000
    broken = json.loads(run.read_text())
    broken["models"]["glm5_2"]["eval"]["checksums"][3]["rms"] += 1.0
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert main(["parity", "compare", str(tmp_path / "broken.json"), "--model", "glm5_2"]) == 1
    assert main([*argv, "--json", str(tmp_path / "missing" / "r.json")]) == 2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(kind="something"), "kind='something'"),
        (lambda d: d.update(format=7), "format=7"),
        (lambda d: d.update(dtype="fp8"), "dtype='fp8'"),
        (lambda d: d["models"]["glm5_2"]["train"]["losses"].__setitem__(0, "NaN"), "losses[0]='NaN'"),
        (lambda d: d["models"]["glm5_2"]["eval"]["checksums"][0].pop("proj"), "checksums[0].proj='None'"),
        (lambda d: d["models"]["glm5_2"]["train"]["losses"].__setitem__(0, 10**400), "expected a finite number"),
        (lambda d: d["models"]["glm5_2"]["train"]["losses"].clear(), "losses: empty"),
        (lambda d: d["models"]["glm5_2"]["eval"]["checksums"][0].update(point="mb0/layers.x"), "checksum point"),
        (
            lambda d: d["models"]["glm5_2"]["eval"]["checksums"].append(d["models"]["glm5_2"]["eval"]["checksums"][1]),
            "recorded twice",
        ),
        (
            lambda d: d["models"]["glm5_2"]["eval"]["topk"]["mb0/layers.0"]["lengths"].__setitem__(0, -1),
            "non-negative integer",
        ),
        (lambda d: d.update(format=True), "format=True"),
        (lambda d: d["models"]["glm5_2"]["eval"]["topk"]["mb0/layers.0"].update(keys="!!"), "malformed top-k"),
    ],
)
def test_a_malformed_run_is_a_named_error_never_a_pass(clean_fp32, workdir, tmp_path, reference, edit, message):
    data = json.loads((workdir / "clean_fp32.json").read_text())
    edit(data)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    with pytest.raises(cmp.ParityCompareError, match=message.replace("[", r"\[").replace("(", r"\(")):
        run = cmp.load(path, RUN_KIND)
        cmp.compare(run, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",))


def test_a_nan_written_as_json_is_refused_and_missing_results_fail(clean_fp32, workdir, tmp_path, reference):
    text = (workdir / "clean_fp32.json").read_text()
    path = tmp_path / "nan.json"
    data = json.loads(text)
    data["models"]["glm5_2"]["train"]["grad_norms"][1] = float("nan")
    path.write_text(json.dumps(data))  # json writes NaN, which json.loads reads back as a float nan
    with pytest.raises(cmp.ParityCompareError, match=r"grad_norms\[1\]='nan'"):
        cmp.compare(cmp.load(path, RUN_KIND), cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",))
    del data["models"]["dense"]
    data["models"]["glm5_2"]["train"]["grad_norms"][1] = 1.0
    data["models"]["glm5_2"]["eval"]["checksums"] = data["models"]["glm5_2"]["eval"]["checksums"][:-5]
    path.write_text(json.dumps(data))
    result = cmp.compare(cmp.load(path, RUN_KIND), cmp.reference_run(reference, "fp32"), reference, models=CPU_MODELS)
    failed = {c.check for c in result.checks if c.status == "fail"}
    assert "dense.model" in failed and any(c.startswith("glm5_2.checksum.mb1/") for c in failed)


def test_tolerances_follow_the_derivation(reference):
    """Each tolerance is max(2 x spread, roundoff floor) of the spreads the reference recorded (bf16 here)."""
    tol = reference["tolerances"]["bf16"]["glm5_2"]
    spreads = reference["measured_spreads"]["bf16"]["glm5_2"]
    worst = max(spreads["fp32"]["logprob_max"], spreads["repeat"]["logprob_max"])
    assert tol["logprob_max"] >= cmp.TRIANGLE * worst
    assert min(tol["topk_min_overlap"].values()) == pytest.approx(
        max(
            0.0,
            1 - cmp.TRIANGLE * (1 - min(spreads["fp32"]["topk_min_overlap"], spreads["repeat"]["topk_min_overlap"])),
        )
    )


def test_precise_sees_a_fault_every_dtype_shares_in_the_wider_runs(workdir, reference):
    """--precise admits a less accurate platform, but a fault its wider run has too (k_norm eps) is caught there."""
    run = run_job(workdir / "k_norm_fp32.json", "fp32", "k_norm_eps", models=("glm5_2",))
    wider = run_job(workdir / "k_norm_fp64.json", "fp64", "k_norm_eps", models=("glm5_2",))
    result = cmp.compare(run, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",), precise=wider)
    failed = {c.check: c for c in result.checks if c.status == "fail"}
    assert "glm5_2.wider" in failed and "a fault every dtype shares" in failed["glm5_2.wider"].detail
    assert "mb0/layers.0.indexer.k_norm" in failed["glm5_2.wider"].detail


def test_empty_or_unjudgeable_comparisons_never_pass(clean_fp32, workdir, tmp_path, reference):
    data = json.loads((workdir / "clean_fp32.json").read_text())
    empty = {**data, "models": {}}
    (tmp_path / "empty.json").write_text(json.dumps(empty))
    with pytest.raises(cmp.ParityCompareError, match="no models"):
        cmp.compare(clean_fp32, cmp.load(tmp_path / "empty.json", RUN_KIND), reference, "pair")
    broken = json.loads((DEFAULT_REFERENCE).read_text())
    broken["errors"]["fp32"]["glm5_2"]["topk_disagreement"]["mb0/layers.0"] = float("nan")
    (tmp_path / "ref.json").write_text(json.dumps(broken))
    with pytest.raises(cmp.ParityCompareError, match=r"topk_disagreement.mb0/layers.0='nan'"):
        bad_ref = cmp.load(tmp_path / "ref.json", cmp.REFERENCE_KIND)
        cmp.compare(clean_fp32, cmp.reference_run(bad_ref, "fp32"), bad_ref, models=("glm5_2",))
    broken["errors"]["fp32"]["glm5_2"]["checksums"] = []
    (tmp_path / "ref.json").write_text(json.dumps(broken))
    with pytest.raises(cmp.ParityCompareError, match="expected a JSON object"):
        bad_ref = cmp.load(tmp_path / "ref.json", cmp.REFERENCE_KIND)
        cmp.compare(clean_fp32, cmp.reference_run(bad_ref, "fp32"), bad_ref, models=("glm5_2",))


def test_the_first_fault_is_the_shallowest_and_exact_mode_fails_on_extra_points(clean_fp32, reference):
    run = json.loads(json.dumps(clean_fp32))
    points = run["models"]["glm5_2"]["eval"]["checksums"]
    for record in points:
        if record["point"] in ("mb0/logits", "mb1/layers.0.self_attention"):
            record["rms"] += 1.0
    result = cmp.compare(run, clean_fp32, reference, "exact", models=("glm5_2",))
    assert result.first_fault["glm5_2"] == "mb1/layers.0.self_attention"  # depth 0 before the logits of mb0
    extra = json.loads(json.dumps(clean_fp32))
    extra["models"]["glm5_2"]["eval"]["checksums"].append({**points[0], "point": "mb0/embedding#2"})
    failed = {c.check for c in cmp.compare(extra, clean_fp32, reference, "exact", models=("glm5_2",)).checks
              if c.status == "fail"}  # fmt: skip
    assert "glm5_2.checksum.extra" in failed


def test_the_fused_indexer_exemption_holds_only_for_an_ascend_run(clean_fp32, reference):
    run = json.loads(json.dumps(clean_fp32))
    evaluation = run["models"]["glm5_2"]["eval"]
    evaluation["checksums"] = [
        c for c in evaluation["checksums"] if not c["point"].endswith((".indexer.q", ".indexer.k"))
    ]
    evaluation["indexer_qk"] = False
    assert cmp.compare(run, clean_fp32, reference, "pair", models=("glm5_2",)).failed  # a CPU run: no exemption
    run["platform"] = "ascend"
    result = cmp.compare(run, clean_fp32, reference, "pair", models=("glm5_2",))
    assert not result.failed and any(c.check == "glm5_2.checksum.indexer" and c.status == "warn" for c in result.checks)


def test_a_plot_in_an_unknown_format_is_refused_before_anything_is_written(clean_fp32, workdir, tmp_path):
    from verl_npu.cli import main

    report = tmp_path / "report.json"
    argv = [
        "parity",
        "compare",
        str(workdir / "clean_fp32.json"),
        "--json",
        str(report),
        "--plot",
        str(tmp_path / "p.txt"),
    ]
    assert main(argv) == 2 and not report.exists()
