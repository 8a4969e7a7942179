"""Platform parity (issues 19 and 30): the parity job on the CPU judged as the nightly judges a node.

- fp32 against the CUDA reference: the CPU run's every block fed the reference's own fp32 inputs (``--replay-from``
  the reference), each block's output within TRIANGLE x the reference's measured error of that block;
- bf16 against the node's own fp32 run: the bf16 run's blocks fed that fp32 run's inputs (``--replay-from`` it),
  judged with ``--precise`` it and the reference's measured bf16 error.

The runs are the session's (tests_npu/support/parity_runs.py), shared with tests_npu/parity/test_parity_faults.py. The
reference is ci/baselines/parity/reference.json, recorded on nvidia-h200.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("mbridge", reason="the parity job builds through mbridge; not installed here")

from support.parity_runs import CPU_MODELS
from test_parity_faults import replayed

from verl_npu.parity import compare as cmp
from verl_npu.parity.cli import DEFAULT_REFERENCE
from verl_npu.parity.run_format import RUN_KIND

REPLAYED_MODELS = ("glm5_2", "dense")  # the fused-shape model records no block tensors (too large) on any platform


@pytest.fixture(scope="module")
def reference():
    return cmp.load(DEFAULT_REFERENCE, cmp.REFERENCE_KIND)


@pytest.fixture(scope="module")
def fp32(parity_runs):
    """The clean CPU fp32 run, each block fed the reference's fp32 inputs."""
    return replayed(parity_runs, "fp32", DEFAULT_REFERENCE)


@pytest.fixture(scope="module")
def fp32_path(parity_runs, fp32):
    return parity_runs.path("fp32", "none", CPU_MODELS, ("--replay-from", str(DEFAULT_REFERENCE)))


@pytest.fixture(scope="module")
def bf16(parity_runs, fp32_path):
    """The clean CPU bf16 run, each block fed the clean CPU fp32 run's inputs (the nightly's second run)."""
    return replayed(parity_runs, "bf16", fp32_path)


def _failures(result: cmp.Comparison) -> list[tuple[str, str]]:
    return [(c.check, c.detail) for c in result.checks if c.status == "fail"]


def test_the_reference_is_an_nvidia_h200_format_2_reference_with_replay_errors(reference):
    assert "H200" in reference["device"] and reference["format"] == cmp.FORMAT == 2
    assert reference["versions"]["transformers"] == "5.10.4"  # the stack's (pyproject.toml), not the machine's
    assert set(reference["runs"]) == {"bf16", "fp32"}  # fp64 only measured the fp32 error; it is not kept
    for dtype in ("bf16", "fp32"):
        run = reference["runs"][dtype]
        assert run["dtype"] == dtype and run["platform"] == "cuda"
        for model in REPLAYED_MODELS:
            assert cmp.has_replay(run, model), (dtype, model)  # the inputs a platform's blocks are fed
            measured = cmp._replay_errors_of(reference, dtype, model)
            blocks = measured["blocks"]
            assert {p.rsplit(".", 1)[-1] for p in blocks} == {"self_attention", "mlp"}
            assert all(0.0 < v["rel_l2"] < (0.5 if dtype == "bf16" else 1e-5) for v in blocks.values()), (dtype, model)
            assert measured["gradients"] and (measured["updates"] or dtype == "bf16")


def test_a_clean_cpu_fp32_run_passes_against_the_cuda_reference(fp32, reference):
    result = cmp.compare(fp32, cmp.reference_run(reference, "fp32"), reference, models=CPU_MODELS)
    assert not result.failed, _failures(result)[:10]
    assert result.first_fault == {"glm5_2": None, "dense": None}
    for model in REPLAYED_MODELS:  # judged block by block: every block of both micro-batches has its ratio
        blocks = [p for p, _ in result.layer_differences[model]]
        assert any(p.startswith("mb1/") for p in blocks) and any(p.endswith(".mlp") for p in blocks), blocks
        assert {c.check: c.status for c in result.checks}[f"{model}.replay"] == "ok"


def test_a_clean_cpu_bf16_run_passes_against_its_own_fp32_run(bf16, fp32, reference):
    result = cmp.compare(bf16, cmp.reference_run(reference, "bf16"), reference, models=CPU_MODELS, precise=fp32)
    assert not result.failed, _failures(result)[:10]
    statuses = {c.check: c.status for c in result.checks}
    assert statuses["glm5_2.bf16-vs-own-fp32"] == statuses["dense.bf16-vs-own-fp32"] == "ok"


def test_the_same_build_twice_is_bitwise_equal_on_the_cpu(parity_runs, fp32, reference):
    """A run of the dense model alone: the same model, built and replayed again, in another process."""
    again = replayed(parity_runs, "fp32", DEFAULT_REFERENCE, models=("dense",))
    assert not cmp.compare(again, fp32, reference, "exact", models=("dense",)).failed
    edited = json.loads(json.dumps(again))
    edited["models"]["dense"]["eval"]["logprobs"][0][0] += 2.0**-40
    assert cmp.compare(edited, fp32, reference, "exact", models=("dense",)).failed


def test_each_block_tolerance_is_twice_the_references_measured_error(fp32, reference):
    """Just inside TRIANGLE x the recorded error of a block passes; just outside fails, named at that block."""
    spread = cmp.replay_spread(fp32, cmp.reference_run(reference, "fp32"), "glm5_2")
    measured = cmp._replay_errors_of(reference, "fp32", "glm5_2")
    for point in ("mb0/layers.1.self_attention", "mb1/layers.3.mlp"):
        limit = cmp.TRIANGLE * measured["blocks"][point]["rel_l2"]
        assert limit > cmp.UNIT_ROUNDOFF["fp32"]  # the measured error sets it, not the roundoff floor
        for factor, fails in ((0.99, False), (1.01, True)):
            blocks = {**spread.blocks, point: {"rel_l2": factor * limit}}
            checks, _, first = cmp.replay_checks("glm5_2", dataclasses.replace(spread, blocks=blocks), measured,
                                                 "fp32", "replay")  # fmt: skip
            assert (first == point) is fails and any(c.status == "fail" for c in checks) is fails, (point, factor)


def test_an_fp32_gradient_group_is_allowed_the_reduction_order_factor_and_a_bf16_one_is_not(fp32, reference):
    """fp32: a group passes just inside TRIANGLE x GRADIENT_REDUCTION_ORDER x its measured error and fails just
    outside; a bf16 group fails just outside the plain TRIANGLE x (its error is its own rounding)."""
    spread = cmp.replay_spread(fp32, cmp.reference_run(reference, "fp32"), "glm5_2")
    group = "layers.6.mlp"
    for dtype, error, factor in (("fp32", None, cmp.GRADIENT_REDUCTION_ORDER), ("bf16", 0.01, 1.0)):
        measured = cmp._replay_errors_of(reference, "fp32", "glm5_2")
        if error is None:
            error = measured["gradients"][group]
        measured = {**measured, "gradients": {**measured["gradients"], group: error}}
        limit = cmp.TRIANGLE * factor * error
        assert cmp.TRIANGLE * error > cmp.UNIT_ROUNDOFF[dtype]  # the measured error sets it, not the roundoff floor
        for scale, fails in ((0.99, False), (1.01, True)):
            changed = dataclasses.replace(spread, gradients={**spread.gradients, group: scale * limit})
            checks, _, _ = cmp.replay_checks("glm5_2", changed, measured, dtype, "replay")
            status = {c.check: c.status for c in checks}[f"glm5_2.replay.gradients.{group}"]
            assert (status == "fail") is fails, (dtype, scale)


def test_precise_takes_the_bf16_runs_fp32_run_from_its_own_node(fp32, bf16, reference):
    with pytest.raises(cmp.ParityCompareError, match="takes a bf16 run's fp32 run only"):
        cmp.compare(fp32, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",), precise=fp32)
    with pytest.raises(cmp.ParityCompareError, match="takes a bf16 run's fp32 run only"):
        cmp.compare(bf16, cmp.reference_run(reference, "bf16"), reference, models=("glm5_2",), precise=bf16)
    elsewhere = cmp.reference_run(reference, "fp32")  # an fp32 run, from nvidia-h200
    with pytest.raises(cmp.ParityCompareError, match="its own platform"):
        cmp.compare(bf16, cmp.reference_run(reference, "bf16"), reference, models=("glm5_2",), precise=elsewhere)


def test_a_run_replayed_from_another_source_is_refused_by_name(bf16, reference):
    """The bf16 run was fed the CPU fp32 run's inputs: judged against the reference's blocks, it is refused."""
    with pytest.raises(cmp.ParityCompareError, match=r"replayed from .* not from .*remake the run with --replay-from"):
        cmp.compare(bf16, cmp.reference_run(reference, "bf16"), reference, models=("glm5_2",))


# The main check of each mode fails through its own block tolerance on a fault it must see (acceptance: no mode's
# main check is unfalsifiable). The same runs are judged in tests_npu/parity/test_parity_faults.py.
def test_the_reference_modes_block_check_fails_on_an_attention_fault(parity_runs, reference):
    run = replayed(parity_runs, "fp32", DEFAULT_REFERENCE, "mla_norm_eps", ("glm5_2",))
    result = cmp.compare(run, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",))
    first = result.first_fault["glm5_2"]
    assert first == "mb0/layers.0.self_attention", _failures(result)[:6]
    failed = {c.check: c for c in result.checks if c.status == "fail"}
    assert f"glm5_2.replay.{first}" in failed and "fed the source's input" in failed[f"glm5_2.replay.{first}"].detail
    assert failed["glm5_2.replay"].detail.endswith(first)


def test_the_bf16_vs_own_fp32_modes_block_check_fails_on_a_bf16_only_fault(parity_runs, fp32, fp32_path, reference):
    """The router in bf16 changes nothing in fp32: the node's fp32 run is the clean one, and its bf16 run is fed it."""
    run = replayed(parity_runs, "bf16", fp32_path, "router_activation_dtype", ("glm5_2",))
    result = cmp.compare(run, cmp.reference_run(reference, "bf16"), reference, models=("glm5_2",), precise=fp32)
    # measured: a MoE block (layer 7's); layer 3's, the first MoE layer's, is within the bf16 error measured there
    assert result.first_fault["glm5_2"] == "mb0/layers.7.mlp", _failures(result)[:6]
    failed = {c.check for c in result.checks if c.status == "fail"}
    assert "glm5_2.bf16-vs-own-fp32.mb0/layers.7.mlp" in failed, sorted(failed)
    assert not any(".layers.0." in c or "/layers.0." in c for c in failed)  # no error carried from the layers before


def test_the_cli_compare_writes_json_and_a_plot_and_exits_by_verdict(fp32, fp32_path, tmp_path):
    from verl_npu.cli import main

    report, picture = tmp_path / "report.json", tmp_path / "layers.png"
    argv = ["parity", "compare", str(fp32_path), "--model", "glm5_2", "--model", "dense"]
    assert main([*argv, "--json", str(report), "--plot", str(picture)]) == 0
    data = json.loads(report.read_text())
    assert data["verdict"] == "ok" and data["mode"] == "reference" and picture.stat().st_size > 1000
    broken = json.loads(fp32_path.read_text())
    broken["models"]["glm5_2"]["eval"]["replay"]["replayed"]["logprobs"][0][0][5] += 1.0
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert main(["parity", "compare", str(tmp_path / "broken.json"), "--model", "glm5_2", "--json", str(report)]) == 1
    data = json.loads(report.read_text())
    assert data["verdict"] == "fail"
    assert any(c["check"] == "glm5_2.replay.logprobs.max" and c["status"] == "fail" for c in data["checks"])
    assert main([*argv, "--json", str(tmp_path / "missing" / "r.json")]) == 2


def _replay(d: dict) -> dict:
    return d["models"]["glm5_2"]["eval"]["replay"]["replayed"]


def _first_output(d: dict) -> dict:
    return _replay(d)["outputs"]["mb0/layers.1.mlp"]


def _other_group(d: dict) -> None:
    groups = d["models"]["glm5_2"]["train"]["gradients"]
    groups["no_such_group"] = groups.pop(sorted(groups)[0])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(kind="something"), "kind='something'"),
        (lambda d: d.update(format=1), "format=1"),
        (lambda d: d.update(format=True), "format=True"),
        (lambda d: d.update(dtype="fp8"), "dtype='fp8'"),
        (lambda d: d["models"]["glm5_2"]["train"]["losses"].__setitem__(0, "NaN"), "losses[0]='NaN'"),
        (lambda d: d["models"]["glm5_2"]["train"]["losses"].clear(), "losses: empty"),
        (lambda d: _first_output(d).update(dtype="int8"), "mb0/layers.1.mlp.dtype='int8'"),
        (lambda d: _first_output(d).update(shape=[0, 2]), "mb0/layers.1.mlp.shape=[0, 2]"),
        (lambda d: _first_output(d).update(data="!!"), "mb0/layers.1.mlp.data: not base64 zlib data"),
        (lambda d: _first_output(d)["shape"].__setitem__(0, 47), "mb0/layers.1.mlp.data: .* bytes for shape"),
        (lambda d: _replay(d)["source"].update(digest="0" * 64), "replayed from"),
        (lambda d: _replay(d)["outputs"].pop("mb1/layers.2.self_attention"), "a block did not run"),
        (lambda d: d["models"]["glm5_2"]["eval"]["replay"].update(replayed=None), "the run was not replayed"),
        (_other_group, "train.gradients: groups"),
        (lambda d: d["models"]["glm5_2"]["train"]["update"]["actual"].clear(), "update.actual: empty"),
    ],
)
def test_a_malformed_run_is_a_named_error_never_a_pass(fp32_path, tmp_path, reference, edit, message):
    data = json.loads(fp32_path.read_text())
    edit(data)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    with pytest.raises(cmp.ParityCompareError, match=message.replace("[", r"\[").replace("(", r"\(")):
        run = cmp.load(path, RUN_KIND)
        cmp.compare(run, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["errors"]["fp32"]["glm5_2"]["replay"]["blocks"]["mb0/layers.0.mlp"].update(rel_l2=float("nan")),
         r"blocks.mb0/layers.0.mlp.rel_l2='nan'"),
        (lambda r: r["errors"]["fp32"]["glm5_2"]["replay"]["blocks"]["mb0/layers.0.mlp"].update(rel_l2=-1.0),
         "an error is never negative"),
        (lambda r: r["errors"]["fp32"]["glm5_2"].update(replay=[]), "expected a JSON object"),
    ],
)  # fmt: skip
def test_a_malformed_reference_is_a_named_error(fp32, tmp_path, edit, message):
    data = json.loads(DEFAULT_REFERENCE.read_text())
    edit(data)
    (tmp_path / "ref.json").write_text(json.dumps(data))
    with pytest.raises(cmp.ParityCompareError, match=message):
        bad = cmp.load(tmp_path / "ref.json", cmp.REFERENCE_KIND)
        cmp.compare(fp32, cmp.reference_run(bad, "fp32"), bad, models=("glm5_2",))


def test_a_block_the_reference_never_measured_fails(fp32, reference):
    data = json.loads(json.dumps(reference))
    del data["errors"]["fp32"]["glm5_2"]["replay"]["blocks"]["mb1/layers.2.mlp"]
    result = cmp.compare(fp32, cmp.reference_run(data, "fp32"), data, models=("glm5_2",))
    assert result.failed and result.first_fault["glm5_2"] == "mb1/layers.2.mlp"


def test_the_end_to_end_checks_are_a_summary_when_blocks_are_judged(fp32, reference):
    """Breaking only the end-to-end values warns (errors carried from every layer); exact mode still fails."""
    run = json.loads(json.dumps(fp32))
    run["models"]["glm5_2"]["eval"]["logprobs"][0][3] += 1.0
    result = cmp.compare(run, cmp.reference_run(reference, "fp32"), reference, models=("glm5_2",))
    summary = {c.check: c for c in result.checks if c.check == "glm5_2.logprobs.max"}["glm5_2.logprobs.max"]
    assert not result.failed and summary.status == "warn" and "summary, end to end" in summary.detail
    assert cmp.compare(run, fp32, reference, "exact", models=("glm5_2",)).failed


def test_a_plot_in_an_unknown_format_is_refused_before_anything_is_written(fp32_path, tmp_path):
    from verl_npu.cli import main

    report = tmp_path / "report.json"
    argv = ["parity", "compare", str(fp32_path), "--json", str(report), "--plot", str(tmp_path / "p.txt")]
    assert main(argv) == 2 and not report.exists()
