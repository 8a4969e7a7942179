"""Preflight's numbers (issue 18): every value it computes with is parsed at one boundary, typed and in range.

The reported bugs, each as a test: a wrong GO (negative or fractional parallel sizes, negative batches and lengths,
a model config with a negative vocab or a fractional hidden size, ``--host-memory-gib 0``), a crash (an FSDP launch,
sizes of 0, a section deleted with ``~key``, ``--json`` into a missing directory) and a hang (a model of 10**9
layers). A value out of range is a FAIL check naming the key, the value and what is allowed (every one of them in
one run), and the verdict is NO-GO; a malformed CLI option is exit 2 with nothing written.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from support.paths import REPO

from verl_npu.checks import FAIL, OK, WARN, Check
from verl_npu.preflight import run_preflight
from verl_npu.preflight.mesh import check_mesh
from verl_npu.preflight.model_shape import ModelShape, load_config
from verl_npu.preflight.values import InputErrors, read_launch

LAUNCH = REPO / "examples" / "glm5_2" / "run_glm5_2_grpo_a3.sh"
MEGATRON = "actor_rollout_ref.actor.megatron"
TINY = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}  # fmt: skip
# a small Megatron launch that is GO with TINY (its model path is not on this machine: --model-config gives it)
OVERRIDES = [
    "--config-name=ppo_megatron_trainer",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor_rollout_ref.model.path=/nonexistent/tiny",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    f"{MEGATRON}.tensor_model_parallel_size=2",
    f"{MEGATRON}.vanilla_mbridge=True",
    "actor_rollout_ref.ref.megatron.vanilla_mbridge=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=8",
]


def fails(report) -> list[Check]:
    return [c for c in report.checks if c.status == FAIL]


def value_failures(checks) -> dict[str, str]:
    """key -> detail of each ``config.value`` / ``config.model-value`` FAIL check (the detail starts "KEY=VALUE:")."""
    found = {}
    for c in checks:
        if c.status == FAIL and c.check in ("config.value", "config.model-value"):
            found[c.detail.split("=", 1)[0].split(": ")[-1]] = c.detail
    return found


@pytest.fixture(scope="module")
def megatron_config() -> dict:
    """verl's composed ppo_megatron_trainer config with OVERRIDES, resolved to plain containers (composed once)."""
    from verl_npu.preflight.compose import _compose, as_mapping

    return as_mapping(_compose("ppo_megatron_trainer", OVERRIDES[1:]))


def edited(config: dict, **changes) -> dict:
    """A deep copy with ``path__to__key=value`` set (``...=DELETE`` removes the key, as Hydra's ``~key`` does)."""
    out = copy.deepcopy(config)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = out
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return out


DELETE = object()
ACTOR_MCORE = "actor_rollout_ref__actor__megatron"


# --- the boundary, without the worker ---------------------------------------------------------------------------
def test_the_composed_launch_reads_into_a_typed_view(megatron_config):
    values, checks = read_launch(megatron_config)
    assert checks == [] and values is not None
    assert (values.world, values.actor.parallelism.tp, values.actor.parallelism.etp, values.rollout.tp) == (8, 2, 2, 2)
    assert values.strategy == "megatron" and values.ref is not None and values.critic is None
    checks, mesh = check_mesh(values, num_layers=4, num_experts=0)
    assert mesh is not None and mesh.dp == 4 and all(c.status == OK for c in checks), checks


@pytest.mark.parametrize(
    ("changes", "key", "allowed"),
    [
        pytest.param({f"{ACTOR_MCORE}__tensor_model_parallel_size": -2},
                     f"{MEGATRON}.tensor_model_parallel_size", "an integer from 1 to 65536", id="tp-negative"),
        pytest.param({f"{ACTOR_MCORE}__tensor_model_parallel_size": 2.5},
                     f"{MEGATRON}.tensor_model_parallel_size", "an integer", id="tp-fractional"),
        pytest.param({f"{ACTOR_MCORE}__tensor_model_parallel_size": 2.0},
                     f"{MEGATRON}.tensor_model_parallel_size", "an integer", id="tp-float"),
        pytest.param({f"{ACTOR_MCORE}__tensor_model_parallel_size": 0},
                     f"{MEGATRON}.tensor_model_parallel_size", "from 1", id="tp-zero"),
        pytest.param({f"{ACTOR_MCORE}__pipeline_model_parallel_size": 0},
                     f"{MEGATRON}.pipeline_model_parallel_size", "from 1", id="pp-zero"),
        pytest.param({"trainer__nnodes": 0}, "trainer.nnodes", "from 1", id="nnodes-zero"),
        pytest.param({"actor_rollout_ref__actor__ppo_mini_batch_size": 0},
                     "actor_rollout_ref.actor.ppo_mini_batch_size", "from 1", id="mini-batch-zero"),
        pytest.param({"data__train_batch_size": -16}, "data.train_batch_size", "from 1", id="batch-negative"),
        pytest.param({"data__max_prompt_length": -512}, "data.max_prompt_length", "from 1", id="prompt-negative"),
        pytest.param({"actor_rollout_ref__rollout__n": 0}, "actor_rollout_ref.rollout.n", "from 1", id="n-zero"),
        pytest.param({f"{ACTOR_MCORE}__sequence_parallel": 1},
                     f"{MEGATRON}.sequence_parallel", "true or false", id="bool-as-int"),
        pytest.param({"actor_rollout_ref__rollout__gpu_memory_utilization": 1.5},
                     "actor_rollout_ref.rollout.gpu_memory_utilization", "from 0 to 1", id="utilization-above-1"),
        pytest.param({f"{ACTOR_MCORE}__dtype": "bogus"}, f"{MEGATRON}.dtype", "unknown dtype", id="dtype"),
        pytest.param({f"{ACTOR_MCORE}__override_transformer_config__recompute_num_layers": -1},
                     f"{MEGATRON}.override_transformer_config.recompute_num_layers", "from 1", id="recompute-layers"),
        pytest.param({f"{ACTOR_MCORE}__override_transformer_config__recompute_granularity": "most"},
                     f"{MEGATRON}.override_transformer_config.recompute_granularity", "one of full, selective",
                     id="recompute-granularity"),
        pytest.param({"trainer__nnodes": 1 << 20, "trainer__n_gpus_per_node": 1 << 20},
                     "trainer.nnodes x trainer.n_gpus_per_node", "at most 1048576 devices", id="world-huge"),
        pytest.param({f"{ACTOR_MCORE}": DELETE}, MEGATRON, "a section of keys (it is missing", id="deleted-megatron"),
        pytest.param({"trainer": DELETE}, "trainer", "a section of keys (it is missing", id="deleted-trainer"),
        pytest.param({"data__max_response_length": DELETE}, "data.max_response_length", "a value (it is missing)",
                     id="deleted-key"),
    ],
)  # fmt: skip
def test_a_value_out_of_range_is_a_named_fail_and_no_view(megatron_config, changes, key, allowed):
    values, checks = read_launch(edited(megatron_config, **changes))
    assert values is None
    found = value_failures(checks)
    assert key in found and allowed in found[key], checks


def test_every_bad_value_of_a_launch_is_reported_at_once(megatron_config):
    bad = edited(megatron_config, data__train_batch_size=-16, data__max_prompt_length=-512,
                 actor_rollout_ref__actor__ppo_mini_batch_size=0, trainer__nnodes=0,
                 **{f"{ACTOR_MCORE}__tensor_model_parallel_size": -2})  # fmt: skip
    values, checks = read_launch(bad)
    assert values is None
    assert {"data.train_batch_size", "data.max_prompt_length", "actor_rollout_ref.actor.ppo_mini_batch_size",
            "trainer.nnodes", f"{MEGATRON}.tensor_model_parallel_size"} <= set(value_failures(checks))  # fmt: skip


def test_an_optional_section_deleted_with_tilde_reads_as_its_defaults(megatron_config):
    values, checks = read_launch(edited(megatron_config, **{f"{ACTOR_MCORE}__override_transformer_config": DELETE}))
    assert checks == [] and values.actor.recompute_granularity is None
    assert values.actor.parallelism.first_stage_layers is None


def test_a_section_that_is_not_a_mapping_is_named(megatron_config):
    values, checks = read_launch(edited(megatron_config, **{f"{ACTOR_MCORE}__override_transformer_config": 5}))
    assert values is None
    assert value_failures(checks)[f"{MEGATRON}.override_transformer_config"].endswith("expected a section of keys")


def test_an_fsdp_launch_has_no_megatron_actor_and_the_mesh_says_what_it_skips():
    from verl_npu.preflight.compose import _compose, as_mapping

    config = as_mapping(
        _compose("ppo_trainer", ["actor_rollout_ref.model.path=/x", "actor_rollout_ref.rollout.name=vllm"])
    )
    values, checks = read_launch(config)
    assert checks == [] and values.strategy == "fsdp" and values.actor is None and values.megatron_roles == {}
    checks, mesh = check_mesh(values, num_layers=4, num_experts=0)
    assert mesh is None
    skipped = [c for c in checks if c.check == "mesh.actor-not-checked"]
    assert skipped and skipped[0].status == WARN and "strategy fsdp" in skipped[0].detail
    assert any(c.check == "mesh.rollout-mesh" for c in checks)  # the rollout's mesh does not depend on the actor


@pytest.mark.parametrize(
    ("changes", "keys"),
    [
        ({"vocab_size": -1000}, ["vocab_size"]),
        ({"hidden_size": 256.5}, ["hidden_size"]),
        ({"num_hidden_layers": 1e9}, ["num_hidden_layers"]),
        ({"num_hidden_layers": 10**9}, ["num_hidden_layers"]),
        ({"num_attention_heads": True}, ["num_attention_heads"]),
        (
            {"vocab_size": -1, "hidden_size": 2.5, "num_hidden_layers": 0},
            ["vocab_size", "hidden_size", "num_hidden_layers"],
        ),
    ],
)
def test_a_model_config_value_out_of_range_is_named_before_anything_loops(changes, keys):
    cfg = {**TINY, "model_type": "mystery", **changes}
    with pytest.raises(InputErrors) as shape_error:
        ModelShape.from_dict(cfg)
    with pytest.raises(InputErrors) as load_error:  # a known family: refused before transformers builds its class
        load_config({**TINY, **changes})
    for error in (shape_error.value, load_error.value):
        assert [e.key for e in error.errors] == keys or sorted(e.key for e in error.errors) == sorted(keys)


def test_a_model_of_a_billion_layers_is_refused_at_once(tmp_path):
    """transformers' config classes loop over num_hidden_layers: 10**9 layers would never return."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "num_hidden_layers": 10**9}))
    start = time.monotonic()
    with pytest.raises(InputErrors, match=r"num_hidden_layers=1000000000: expected an integer from 1 to 4096"):
        load_config(path)
    assert time.monotonic() - start < 5


def test_a_config_json_that_is_not_json_is_not_replaced_by_a_stand_in(tmp_path):
    from verl_npu.preflight.model import resolve_model

    (tmp_path / "config.json").write_text("{not json")
    hf, check, _ = resolve_model(str(tmp_path), None, str(REPO / "examples" / "glm5_2" / "config.json"))
    assert hf is None and check.status == FAIL and "not a JSON model config" in check.detail


# --- the pipeline with a stand-in worker: the model's values become FAIL checks, and nothing computes ------------
class _Worker:
    """Answers like the preflight worker (verl accepts the config) with a given HF config; starts no process."""

    running = False

    def __init__(self, hf):
        self.hf = hf

    def cached_composition(self):
        return None

    def ask(self, config, model_path, model_config, compose_checks=()):
        return self.hf, Check("config.model", OK, "stand-in"), [Check("config.verl-validation", OK, "stand-in")], None

    def cancel(self):
        pass


def preflight_with(monkeypatch, hf, *overrides):
    from verl_npu.preflight import pipeline

    monkeypatch.setattr(pipeline, "start_worker", lambda *a: _Worker(hf))
    return run_preflight(None, [*OVERRIDES, *overrides])


def test_model_values_out_of_range_are_fail_checks_and_no_estimate(monkeypatch):
    report = preflight_with(monkeypatch, {**TINY, "model_type": "mystery", "vocab_size": -5, "hidden_size": 2.5})
    assert report.verdict == "no-go" and report.memory is None and report.model is None
    assert set(value_failures(report.checks)) == {"vocab_size", "hidden_size"}
    assert not any(c.area in ("mesh", "memory", "engine") for c in report.checks)
    assert any(c.check == "config.not-computed" and c.status == WARN for c in report.checks)


def test_the_stand_in_pipeline_is_go_on_the_good_launch(monkeypatch):
    report = preflight_with(monkeypatch, load_config(TINY))
    assert report.verdict == "go", fails(report)
    assert report.memory is not None and report.memory.fits


def test_a_negative_tp_never_reaches_the_mesh(monkeypatch):
    """The reported wrong GO: "TP -2 x PP 8 x CP 4 x DP -8 = 512"."""
    report = preflight_with(monkeypatch, load_config(TINY), f"{MEGATRON}.tensor_model_parallel_size=-2")
    assert report.verdict == "no-go"
    assert (
        "expected an integer from 1 to 65536" in value_failures(report.checks)[f"{MEGATRON}.tensor_model_parallel_size"]
    )
    assert not any(c.area in ("mesh", "memory", "engine") for c in report.checks)


def test_a_host_memory_of_zero_is_refused_not_ignored():
    from verl_npu.inputs import InputError

    for bad in (0, -1, float("nan"), float("inf"), "abc", True):
        with pytest.raises(InputError, match="--host-memory-gib"):
            run_preflight(None, OVERRIDES, host_memory_gib=bad)


# --- end to end: the worker runs verl's validation ---------------------------------------------------------------
def test_the_example_with_a_negative_tp_is_no_go_naming_the_key():
    report = run_preflight(LAUNCH, [f"{MEGATRON}.tensor_model_parallel_size=-2"])
    assert report.verdict == "no-go"
    assert f"{MEGATRON}.tensor_model_parallel_size" in value_failures(report.checks)
    assert not [c for c in report.checks if c.check == "mesh.actor-mesh"]  # no "TP -2 x ... x DP -8 = 512"


def test_sizes_of_zero_are_named_and_verls_own_division_by_zero_is_its_verdict(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    report = run_preflight(None, [*OVERRIDES, f"{MEGATRON}.tensor_model_parallel_size=0", "trainer.nnodes=0"],
                           model_config=str(tmp_path / "tiny.json"))  # fmt: skip
    assert report.verdict == "no-go"
    assert {f"{MEGATRON}.tensor_model_parallel_size", "trainer.nnodes"} <= set(value_failures(report.checks))
    (model,) = [c for c in report.checks if c.check == "config.model"]
    assert model.status == OK  # verl's ZeroDivisionError no longer takes the worker (and the model) down
    verl = [c for c in report.checks if c.check == "config.verl-validation"]
    assert verl and "ZeroDivisionError" in verl[0].detail


def test_an_fsdp_launch_runs_verls_validation_and_says_which_checks_do_not_apply(tmp_path):
    """verl's default config (FSDP) crashed with KeyError: 'megatron' once the model resolved."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    report = run_preflight(
        None,
        ["actor_rollout_ref.model.path=/x", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=vllm",
         "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"],
        model_config=str(tmp_path / "tiny.json"),
    )  # fmt: skip
    assert report.verdict == "go", fails(report)
    assert [c.status for c in report.checks if c.check == "config.verl-validation"] == [OK]
    skipped = {c.check: c.status for c in report.checks if c.check.endswith("not-checked")}
    assert skipped == {"mesh.actor-not-checked": WARN, "memory.not-checked": WARN}
    assert report.memory is None and not any(c.area in ("memory", "engine") and c.status == OK for c in report.checks)


def test_deleting_a_group_preflight_reads_is_handled(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    report = run_preflight(None, [*OVERRIDES, f"~{MEGATRON}.override_transformer_config"],
                           model_config=str(tmp_path / "tiny.json"))  # fmt: skip
    assert report.verdict == "go", fails(report)  # no overrides: megatron's defaults
    report = run_preflight(None, [*OVERRIDES, "~actor_rollout_ref"], model_config=str(tmp_path / "tiny.json"))
    assert report.verdict == "no-go"
    assert "actor_rollout_ref" in value_failures(report.checks)


def test_a_model_config_with_values_out_of_range_is_no_go_naming_each(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**TINY, "vocab_size": -1000, "hidden_size": 256.5, "num_hidden_layers": 1e9}))
    start = time.monotonic()
    report = run_preflight(None, OVERRIDES, model_config=str(bad))
    assert time.monotonic() - start < 120
    (model,) = [c for c in report.checks if c.check == "config.model"]
    assert report.verdict == "no-go" and model.status == FAIL
    for text in ("vocab_size=-1000", "hidden_size=256.5", "num_hidden_layers=1000000000.0"):
        assert text in model.detail


# --- the CLI's options: checked before any work -------------------------------------------------------------------
def test_cli_host_memory_of_zero_is_exit_2(capsys):
    from verl_npu.cli import main

    assert main(["preflight", "--host-memory-gib", "0", "--overrides", "--", *OVERRIDES]) == 2
    assert "--host-memory-gib='0': expected a finite number > 0 and <= 1048576" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_cli_output_into_a_missing_directory_is_exit_2_before_any_work(tmp_path, capsys, monkeypatch, option):
    from verl_npu import cli
    from verl_npu.preflight import pipeline

    monkeypatch.setattr(pipeline, "read_launch", lambda *a: pytest.fail("preflight worked before checking --json"))
    target = tmp_path / "missing" / "report.png"
    assert cli.main(["preflight", option, str(target), "--overrides", "--", *OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert f"{option}=" in err and f"directory {target.parent} does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "missing").exists()


def test_cli_plot_with_an_unknown_format_is_exit_2(tmp_path, capsys):
    from verl_npu.cli import main

    assert main(["preflight", "--plot", str(tmp_path / "r.xyz"), "--overrides", "--", *OVERRIDES]) == 2
    assert "ending in one of .png" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_json_report_is_written_whole(tmp_path):
    from verl_npu.preflight.report import PreflightReport, write_json

    path = tmp_path / "r.json"
    path.write_text("old")
    report = PreflightReport("<overrides>", "a3", [Check("x.y", OK, "fine")], [])
    write_json(report, path)
    assert json.loads(path.read_text())["verdict"] == "go" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_null_that_verls_validation_computes_with_is_named_not_pythons_type_error(tmp_path):
    """verl's validate_config multiplies a null micro-batch size: the report named Python's NoneType, not the key."""
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    overrides = [o for o in OVERRIDES if not o.startswith(f"{micro}=")] + [f"{micro}=null"]
    report = run_preflight(None, overrides, model_config=str(tmp_path / "tiny.json"))
    assert report.verdict == "no-go"
    assert not [c for c in report.checks if "NoneType" in c.detail]
    assert [c.detail for c in report.checks if c.check == "config.value"] == [
        f"{micro} is not set (null), and verl validate_config computes with it: set {micro}=N in the launch"
    ]
