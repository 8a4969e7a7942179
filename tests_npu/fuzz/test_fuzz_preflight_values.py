"""Hostile values into preflight's numbers (issue 18): the typed boundary, then the mesh and the memory estimate.

Properties, on values of every kind (negative, zero, huge, float, bool, string, None, lists):
- the launch: ``read_launch`` never raises; when a sampled value is out of range (the spec below, written from
  the keys' meaning, not from the code) there is no view and a FAIL check names that key; otherwise the view feeds
  ``check_mesh``, the actor's build plan and ``estimate_launch`` with no exception but the build plan's named one;
- the model config: ``ModelShape.from_dict`` and ``load_config``'s check raise nothing but ``InputErrors``, name
  every sampled value out of range, and a shape they accept sizes and estimates without an exception;
- the CLI: a malformed ``--host-memory-gib`` or an output path in a missing directory is exit 2 before any work.

The pipeline itself (verl's validation in a worker process, seconds an example) is exercised in
tests_npu/preflight/test_preflight_values.py; here each example costs milliseconds.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from verl_npu.checks import FAIL, failed
from verl_npu.engine.build_plan import BuildPlanError, build_plan
from verl_npu.inputs import MAX_BATCH, MAX_DEVICES, MAX_LAYERS, MAX_PARALLEL, MAX_TOKENS
from verl_npu.preflight.memory import estimate
from verl_npu.preflight.memory_plan import estimate_launch
from verl_npu.preflight.mesh import check_mesh
from verl_npu.preflight.model_shape import SIZES, ModelShape, check_values
from verl_npu.preflight.target import target
from verl_npu.preflight.values import InputErrors, read_launch

MCORE = "actor_rollout_ref.actor.megatron"
OTC = f"{MCORE}.override_transformer_config"
ROLLOUT = "actor_rollout_ref.rollout"
# A valid composed Megatron launch, as plain containers (the keys preflight reads; verl's YAML has more).
BASE: dict[str, Any] = {
    "trainer": {"nnodes": 1, "n_gpus_per_node": 8},
    "data": {"train_batch_size": 16, "max_prompt_length": 256, "max_response_length": 256},
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {"path": "/models/tiny"},
        "actor": {
            "strategy": "megatron",
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 1,
            "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": 4096,
            "optim": {"use_precision_aware_optimizer": False},
            "megatron": {
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 1,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": None,
                "virtual_pipeline_model_parallel_size": None,
                "sequence_parallel": True,
                "use_distributed_optimizer": True,
                "vanilla_mbridge": True,
                "param_offload": False,
                "optimizer_offload": False,
                "dtype": "bfloat16",
                "override_transformer_config": {"recompute_granularity": None, "recompute_num_layers": None},
            },
        },
        "rollout": {"name": "vllm", "n": 2, "tensor_model_parallel_size": 2, "data_parallel_size": 1,
                    "pipeline_model_parallel_size": 1, "expert_parallel_size": 1, "gpu_memory_utilization": 0.5},
    },
}  # fmt: skip

# key -> (kind, minimum, maximum, required): what a launch may hold there (verl's and megatron-core's meaning)
INT, BOOL, NUM = "int", "bool", "number"
SPEC: dict[str, tuple[str, float, float, bool]] = {
    "trainer.nnodes": (INT, 1, MAX_DEVICES, True),
    "trainer.n_gpus_per_node": (INT, 1, MAX_DEVICES, True),
    "data.train_batch_size": (INT, 1, MAX_BATCH, True),
    "data.max_prompt_length": (INT, 1, MAX_TOKENS, True),
    "data.max_response_length": (INT, 1, MAX_TOKENS, True),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (INT, 1, MAX_BATCH, True),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (INT, 1, MAX_BATCH, False),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (INT, 1, MAX_TOKENS, False),
    "actor_rollout_ref.actor.use_dynamic_bsz": (BOOL, 0, 0, False),
    f"{MCORE}.tensor_model_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{MCORE}.pipeline_model_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{MCORE}.context_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{MCORE}.expert_model_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{MCORE}.expert_tensor_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{MCORE}.virtual_pipeline_model_parallel_size": (INT, 1, MAX_LAYERS, False),
    f"{MCORE}.sequence_parallel": (BOOL, 0, 0, False),
    f"{MCORE}.param_offload": (BOOL, 0, 0, False),
    f"{OTC}.num_layers_in_first_pipeline_stage": (INT, 1, MAX_LAYERS, False),
    f"{OTC}.num_layers_in_last_pipeline_stage": (INT, 1, MAX_LAYERS, False),
    f"{OTC}.recompute_num_layers": (INT, 1, MAX_LAYERS, False),
    f"{ROLLOUT}.n": (INT, 1, MAX_BATCH, False),
    f"{ROLLOUT}.tensor_model_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{ROLLOUT}.data_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{ROLLOUT}.expert_parallel_size": (INT, 1, MAX_PARALLEL, False),
    f"{ROLLOUT}.gpu_memory_utilization": (NUM, 0, 1, False),
}
HOSTILE = st.one_of(
    st.integers(min_value=-3, max_value=70),  # mostly plausible sizes, zero and negatives among them
    st.sampled_from([-(2**63), 2**16, 2**16 + 1, 2**20, 2**24 + 1, 2**40, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2.0, 2.5, 1e9, -0.0]),
    st.booleans(),
    st.none(),
    st.sampled_from(["4", " 8 ", "-2", "2.5", "abc", "", "true", "1e3", "0x10"]),
    st.lists(st.integers(), max_size=2),
)


def in_range(key: str, value: Any) -> bool:
    """The spec's answer, independent of verl_npu.inputs: is ``value`` a valid setting for ``key``?"""
    kind, low, high, required = SPEC[key]
    if value is None:
        return not required
    if kind == BOOL:
        return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false"))
    if isinstance(value, bool):
        return False
    if kind == INT:
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value.strip())
        return isinstance(value, int) and low <= value <= high
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, int | float) and value == value and low <= value <= high  # NaN is not in range


def _get(config: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _number(value: Any) -> int:
    return int(value.strip()) if isinstance(value, str) else value


def broken_rules(config: dict) -> list[str]:
    """The keys of the rules between values a launch of in-range values still breaks."""
    broken = []
    nodes, devices = (_number(_get(config, f"trainer.{k}")) for k in ("nnodes", "n_gpus_per_node"))
    if nodes * devices > MAX_DEVICES:
        broken.append("trainer.nnodes x trainer.n_gpus_per_node")
    prompt, response = (_number(_get(config, f"data.max_{k}_length")) for k in ("prompt", "response"))
    if prompt + response > MAX_TOKENS:
        broken.append("data.max_prompt_length + data.max_response_length")
    dynamic = _get(config, "actor_rollout_ref.actor.use_dynamic_bsz")
    dynamic = dynamic.strip().lower() == "true" if isinstance(dynamic, str) else bool(dynamic)
    if dynamic and _get(config, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu") is None:
        broken.append("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")  # the token budget packs the batch
    return broken


def _set(config: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[leaf] = value


TINY_MOE = ModelShape.from_dict(
    {"model_type": "mystery", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
     "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "moe_intermediate_size": 32,
     "num_experts_per_tok": 2}
)  # fmt: skip


@given(st.dictionaries(st.sampled_from(sorted(SPEC)), HOSTILE, min_size=1, max_size=4))
def test_a_launch_value_out_of_range_is_named_and_never_reaches_the_arithmetic(sampled):
    config = copy.deepcopy(BASE)
    for key, value in sampled.items():
        _set(config, key, value)
    values, checks = read_launch(config)  # never raises
    bad = {key for key, value in sampled.items() if not in_range(key, value)}
    details = [c.detail for c in checks if c.status == FAIL]
    for key in bad:
        assert any(d.startswith(f"{key}=") for d in details), (key, details)
    if bad:
        assert values is None
        event("launch: a value out of range")
        return
    broken = broken_rules(config)  # each value in range; the rules between them
    assert (values is None) == bool(broken), (broken, details)
    for key in broken:
        assert any(d.startswith(f"{key}=") for d in details), (key, details)
    if values is None:
        return
    mesh_checks, mesh = check_mesh(values, TINY_MOE.num_layers, TINY_MOE.num_experts)
    if failed(mesh_checks):
        return
    assert mesh is not None and mesh.tp >= 1 and mesh.dp >= 1
    assert all(n >= 1 for n in mesh.stage_layers(TINY_MOE.num_layers))
    megatron = config["actor_rollout_ref"]["actor"]["megatron"]
    try:
        plan = build_plan(megatron, {}, {"rms_norm_eps": 1e-6, "num_attention_heads": 4}, "ascend")
    except BuildPlanError:
        return  # the engine's own named refusal
    result, memory_checks = estimate_launch(values, TINY_MOE, mesh, plan, target("a3"), host_memory_gib=512.0)
    event("launch: estimated")
    assert all(s.train_bytes > 0 for s in result.stages) and memory_checks


@pytest.mark.parametrize("key", sorted(SPEC))
@given(value=HOSTILE)
def test_each_launch_key_alone_is_refused_by_name_when_out_of_range(key, value):
    """One key at a time, every kind of value (the property above mixes keys; this one covers each of them)."""
    config = copy.deepcopy(BASE)
    _set(config, key, value)
    values, checks = read_launch(config)
    if in_range(key, value) and not broken_rules(config):
        assert values is not None, checks
        check_mesh(values, TINY_MOE.num_layers, TINY_MOE.num_experts)  # in range: no exception, whatever it finds
    else:
        assert values is None and any(c.status == FAIL for c in checks)
        if not in_range(key, value):
            assert any(c.detail.startswith(f"{key}=") for c in checks), checks


MODEL_BASE = {
    "model_type": "mystery", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4,
    "moe_intermediate_size": 32, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "index_topk": 8, "index_n_heads": 2, "index_head_dim": 8,
}  # fmt: skip
MODEL_HOSTILE = st.one_of(HOSTILE, st.integers(min_value=0, max_value=5000), st.sampled_from([1e9, 10**9, 2**24]))


def model_value_in_range(key: str, value: Any) -> bool:
    low, high = SIZES[key]
    if value is None:  # "not set": the key's default applies (required keys are named as missing)
        return key not in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size")  # fmt: skip
    if isinstance(value, bool):
        return False
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value.strip())
    return isinstance(value, int) and low <= value <= high


@given(st.dictionaries(st.sampled_from(sorted(MODEL_BASE.keys() - {"model_type"})), MODEL_HOSTILE, min_size=1,
                       max_size=4))  # fmt: skip
def test_a_model_config_value_out_of_range_is_named_and_a_shape_is_always_sizeable(sampled):
    cfg = {**MODEL_BASE, **sampled}
    bad = {key for key, value in sampled.items() if not model_value_in_range(key, value)}
    try:
        check_values(cfg)  # what load_config runs before transformers sees a config.json
    except InputErrors as exc:
        named = {e.key for e in exc.errors}
        assert bad - {k for k, v in sampled.items() if v is None} <= named, (bad, named)
    else:
        assert not bad - {k for k, v in sampled.items() if v is None}
    try:
        shape = ModelShape.from_dict(cfg)
    except InputErrors as exc:
        named = " ".join(str(e) for e in exc.errors)
        for key in bad:
            assert f" {key}=" in named or f"{key}=" in named, (key, named)
        event("model: refused")
        return
    assert not bad, bad
    assert shape.total_params() > 0 and shape.active_params() > 0 and shape.describe()["layers"] == shape.num_layers
    result = estimate(shape, capacity_bytes=64 * 2**30)
    event("model: estimated")
    assert len(result.stages) == 1 and result.stages[0].train_bytes > 0


@pytest.mark.parametrize("key", sorted(MODEL_BASE.keys() - {"model_type"}))
@given(value=MODEL_HOSTILE)
def test_each_model_key_alone_is_refused_by_name_when_out_of_range(key, value):
    cfg = {**MODEL_BASE, key: value}
    if model_value_in_range(key, value):
        # a rule between values (e.g. more routed experts per token than experts) is named too
        with contextlib.suppress(InputErrors):
            assert ModelShape.from_dict(cfg).total_params() > 0
    else:
        with pytest.raises(InputErrors) as exc:
            ModelShape.from_dict(cfg)
        assert key in {e.key for e in exc.value.errors}


@given(st.sampled_from(["0", "-1", "-0.5", "nan", "inf", "-inf", "1e400", "abc", "", "1048577", "0x10", "1,5"]))
def test_cli_a_malformed_host_memory_is_exit_2_before_any_work(run_cli, value):
    code, out, err = run_cli("preflight", f"--host-memory-gib={value}", "--overrides", "--", "trainer.nnodes=1")
    assert code == 2 and "--host-memory-gib" in err and out == ""


@pytest.mark.parametrize("option", ["--json", "--plot"])
@given(name=st.text(alphabet="abcxyz_-.", min_size=1, max_size=12))
def test_cli_an_output_into_a_missing_directory_is_exit_2_and_writes_nothing(run_cli, tmp_path_factory, option, name):
    root = tmp_path_factory.mktemp("out")
    path = root / "missing" / f"{name}.png"
    code, out, err = run_cli("preflight", option, str(path), "--overrides", "--", "trainer.nnodes=1")
    assert code == 2 and option in err and "does not exist" in err and out == ""
    assert list(root.iterdir()) == []
