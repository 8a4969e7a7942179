"""Preflight's model of the vLLM rollout (verl_npu/preflight/rollout.py): the KV cache fit, graph capture against
verl's weight sync, and the host RAM of sleep mode's weight copies, on the GLM-5.2 example and variants of it."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.checks import FAIL, OK
from verl_npu.engine.host_arena import next_power_of_two
from verl_npu.preflight import rollout as rollout_model
from verl_npu.preflight import run_preflight
from verl_npu.preflight.memory import GiB
from verl_npu.preflight.model_shape import ModelShape
from verl_npu.preflight.values import RolloutValues, read_launch

EXAMPLE = REPO / "examples" / "glm5_2"
LAUNCH = EXAMPLE / "run_glm5_2_grpo_a3.sh"
MAX_MODEL_LEN_LINE = "    actor_rollout_ref.rollout.max_model_len=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH)) \\\n"
GLM52 = ModelShape.from_hf(EXAMPLE / "config.json")
EXAMPLE_ROLLOUT = RolloutValues(name="vllm", tp=8, dp=8, pp=1, ep=64, n=8, gpu_memory_utilization=0.8)


def copy_example(tmp_path: Path, script_edit: tuple[str, str] | None = None, env_line: str | None = None) -> Path:
    target = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, target)
    script = target / LAUNCH.name
    if script_edit is not None:
        text = script.read_text()
        assert text.count(script_edit[0]) == 1, script_edit[0]
        script.write_text(text.replace(*script_edit))
    if env_line is not None:
        env = target / "glm5_2.env"
        env.write_text(env.read_text() + env_line + "\n")
    return script


def checks(report, name: str):
    return [c for c in report.checks if c.check == name]


@pytest.fixture(scope="module")
def example():
    return run_preflight(LAUNCH, host_memory_gib=1500)


# --- the KV cache (finding 5) ------------------------------------------------------------------------------------
def test_glm5_2_caches_95232_bytes_per_token_per_rank_as_vllm_ascend_lays_it_out():
    per_layer = rollout_model.kv_bytes_per_token(GLM52, tp=8, dtype_bytes=2)
    # bf16: latent 512 + rope 64 on every layer, + the indexer's 128-wide key on the 21 full layers; not split by TP
    assert per_layer.count(2 * (512 + 64 + 128)) == 21 and per_layer.count(2 * (512 + 64)) == 57
    assert sum(per_layer) == 95_232 == sum(rollout_model.kv_bytes_per_token(GLM52, tp=1, dtype_bytes=2))
    assert [b == 1408 for b in per_layer] == list(GLM52.indexer_full)


def test_one_request_takes_whole_blocks_and_the_largest_fitting_length_is_the_last_that_fits():
    result = rollout_model.estimate(GLM52, EXAMPLE_ROLLOUT, 64 * GiB, 16)
    assert (result.max_model_len, result.max_model_len_origin) == (1_048_576, "max_position_embeddings")
    assert result.needed_kv_bytes() == 1_048_576 * 95_232  # 93 GiB: a multiple of the 128-token block already
    assert result.needed_kv_bytes(129) == 256 * 95_232  # two blocks
    assert result.requested_bytes == int(0.8 * 64 * GiB)
    assert (
        result.available_kv_bytes == result.requested_bytes - result.weights_bytes - rollout_model.PROFILE_RESERVE_BYTES
    )
    largest = result.largest_fitting_len
    assert largest % 128 == 0 and not result.fits
    assert result.needed_kv_bytes(largest) <= result.available_kv_bytes < result.needed_kv_bytes(largest + 1)
    # the weights one rank holds: experts over TP x DP = 64, the rest over TP 8 or replicated (about 30 GB)
    assert 28 * GiB < result.weights_bytes < 29 * GiB


def test_the_rollout_weights_are_the_models_parameters_split_as_vllm_splits_them():
    for model in ("llama", "glm5.2"):
        shape = ModelShape.from_hf(EXAMPLE / "config.json") if model == "glm5.2" else ModelShape.from_dict(
            {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96}
        )  # fmt: skip
        whole = sum(rollout_model.weight_tensors(shape, tp=1, expert_split=1, absorbed=False))
        router_bias = shape.num_experts * sum(shape.is_moe)  # vLLM's e_score_correction_bias is a parameter
        padding = (-shape.vocab_size % 64) * shape.hidden_size * (1 + (not shape.tie_word_embeddings))
        assert whole == shape.total_params() + router_bias + padding, model
    split = rollout_model.weight_tensors(GLM52, tp=8, expert_split=64, absorbed=False)
    whole = rollout_model.weight_tensors(GLM52, tp=1, expert_split=1, absorbed=False)
    experts = 75 * 256 * 3 * 2048 * 6144  # 75 MoE layers of 256 routed experts
    assert sum(whole) - sum(split) > experts * 63 / 64  # the experts shrink 64-fold, the dense TP-split part 8-fold


def _verl_file(relative: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec("verl")
    return (Path(spec.origin).parent / relative).read_text()


def test_verls_default_max_model_len_is_the_models_max_position_embeddings():
    """verl 0.9.1's get_max_position_embeddings, executed on the example's config (its module needs uvicorn, which the
    dev venv lacks, so the function is taken from the file), and the server code that passes it when unset."""
    from transformers import AutoConfig

    source = _verl_file("workers/rollout/utils.py")
    (node,) = [n for n in ast.parse(source).body if getattr(n, "name", None) == "get_max_position_embeddings"]
    namespace: dict = {}
    exec(compile(ast.Module([node], []), "verl/workers/rollout/utils.py", "exec"), namespace)
    hf = AutoConfig.from_pretrained(EXAMPLE)
    assert namespace["get_max_position_embeddings"](hf) == GLM52.max_position_embeddings == 1_048_576
    server = "".join(_verl_file("workers/rollout/vllm_rollout/vllm_async_server.py").split())
    assert "ifself.config.max_model_lenisNone:self.config.max_model_len=max_position_embeddings" in server
    assert '"max_model_len":self.config.max_model_len,' in server
    assert 'compilation_config.setdefault("cudagraph_mode","FULL_AND_PIECEWISE")' in server


def test_the_example_is_go_with_its_max_model_len(example):
    assert example.verdict == "go", [c for c in example.checks if c.status == FAIL]
    (kv,) = checks(example, "rollout.kv-cache")
    assert kv.status == OK and "actor_rollout_ref.rollout.max_model_len=32,768" in kv.detail
    assert "95,232 B of KV cache per token per rank (21 layers x 1,408 B + 57 layers x 1,152 B)" in kv.detail
    assert example.rollout.max_model_len == 24576 + 8192 and example.rollout.fits


def test_without_max_model_len_the_example_is_no_go_naming_the_key_and_what_fits(tmp_path):
    report = run_preflight(copy_example(tmp_path, (MAX_MODEL_LEN_LINE, "")))
    assert report.verdict == "no-go"
    (kv,) = checks(report, "rollout.kv-cache")
    assert kv.status == FAIL
    assert "actor_rollout_ref.rollout.max_model_len is unset" in kv.detail and "(1,048,576)" in kv.detail
    assert "93.0 GiB of KV cache per rank" in kv.detail
    largest = report.rollout.largest_fitting_len
    assert f"The largest actor_rollout_ref.rollout.max_model_len that fits is {largest:,}" in kv.detail
    assert kv.fix == f"set actor_rollout_ref.rollout.max_model_len=32768 (max_prompt_length + max_response_length; " \
        f"at most {largest} fits)"  # fmt: skip
    assert [c.check for c in report.checks if c.status == FAIL] == ["rollout.kv-cache"]


def test_a_max_model_len_the_data_does_not_fit_in_is_reported():
    shape, rollout = GLM52, dataclasses.replace(EXAMPLE_ROLLOUT, max_model_len=16384)
    result = rollout_model.estimate(shape, rollout, 64 * GiB, 16)
    found = rollout_model.kv_cache_checks(result, rollout, shape, prompt=24576, response=8192)
    assert [(c.check, c.status) for c in found] == [("rollout.kv-cache", OK), ("rollout.max-model-len", FAIL)]
    rollout = dataclasses.replace(EXAMPLE_ROLLOUT, max_model_len=2_000_000)
    found = rollout_model.kv_cache_checks(rollout_model.estimate(shape, rollout, 64 * GiB, 16), rollout, shape,
                                          prompt=1024, response=1024)  # fmt: skip
    assert "more than the model's max_position_embeddings (1,048,576)" in found[0].detail
    tiny = dataclasses.replace(EXAMPLE_ROLLOUT, gpu_memory_utilization=0.3)
    (none_left,) = rollout_model.kv_cache_checks(rollout_model.estimate(shape, tiny, 64 * GiB, 16), tiny, shape,
                                                 prompt=1024, response=1024)  # fmt: skip
    assert none_left.status == FAIL and "no memory left for the KV cache" in none_left.detail
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in none_left.fix


def test_engine_kwargs_reach_vllm_over_the_rollouts_own_keys():
    config = {
        "trainer": {"nnodes": 1, "n_gpus_per_node": 8},
        "data": {"train_batch_size": 8, "max_prompt_length": 512, "max_response_length": 512},
        "actor_rollout_ref": {
            "actor": {"strategy": "fsdp", "ppo_mini_batch_size": 8},
            "rollout": {
                "name": "vllm", "max_model_len": 4096, "enforce_eager": False,
                "engine_kwargs": {"vllm": {"max_model_len": 2048, "compilation_config": '{"cudagraph_mode": "full"}'}},
            },
        },
    }  # fmt: skip
    values, found = read_launch(config)
    assert found == [] and values.rollout.max_model_len == 2048 and values.rollout.cudagraph_mode == "FULL"
    assert values.rollout.max_model_len_key == "actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len"
    engine = config["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]
    engine["compilation_config"] = {"cudagraph_mode": "ALWAYS"}
    engine["max_model_len"] = 0
    values, found = read_launch(config)
    assert values is None
    said = " ".join(c.detail for c in found)
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode='ALWAYS'" in said
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=0" in said


# --- graph capture vs the weight sync (finding 6) ------------------------------------------------------------------
def test_the_example_captures_decode_graphs_that_its_weight_syncs_keep_valid(example):
    assert example.rollout is not None
    (graphs,) = checks(example, "rollout.graph-mode")
    assert graphs.status == OK and "cudagraph_mode FULL_DECODE_ONLY" in graphs.detail


def test_fused_mc2_with_graphs_is_no_go_naming_enforce_eager(tmp_path):
    report = run_preflight(copy_example(tmp_path, env_line="VLLM_ASCEND_ENABLE_FUSED_MC2=1"))
    (graphs,) = checks(report, "rollout.graph-mode")
    assert graphs.status == FAIL and "VLLM_ASCEND_ENABLE_FUSED_MC2=1 with device graphs" in graphs.detail
    assert "actor_rollout_ref.rollout.enforce_eager=True" in graphs.fix
    eager = dataclasses.replace(EXAMPLE_ROLLOUT, enforce_eager=True)
    (graphs,) = rollout_model.graph_checks(eager, GLM52, {"VLLM_ASCEND_ENABLE_FUSED_MC2": "1"}, "ascend")
    assert graphs.status == OK and "NONE (enforce_eager=True)" in graphs.detail


def test_nz_weights_and_unreadable_values_are_refused():
    shape = GLM52
    (nz,) = rollout_model.graph_checks(EXAMPLE_ROLLOUT, shape, {"VLLM_ASCEND_ENABLE_NZ": "2"}, "ascend")
    assert nz.check == "rollout.weight-nz" and nz.status == FAIL and "VLLM_ASCEND_ENABLE_NZ" in nz.fix
    (bad,) = rollout_model.graph_checks(EXAMPLE_ROLLOUT, shape, {"VLLM_ASCEND_ENABLE_FUSED_MC2": "yes"}, "ascend")
    assert bad.status == FAIL and "VLLM_ASCEND_ENABLE_FUSED_MC2='yes'" in bad.detail
    additional = dataclasses.replace(EXAMPLE_ROLLOUT, enable_fused_mc2=2)
    (mc2,) = rollout_model.graph_checks(additional, shape, {"VLLM_ASCEND_ENABLE_FUSED_MC2": "0"}, "ascend")
    assert mc2.status == FAIL and "additional_config.enable_fused_mc2=2" in mc2.detail  # it wins over the variable
    assert rollout_model.graph_checks(EXAMPLE_ROLLOUT, shape, {"VLLM_ASCEND_ENABLE_NZ": "2"}, "cuda") == []


# --- host RAM of sleep mode (finding 7) ------------------------------------------------------------------------
def test_every_node_holds_its_ranks_sleep_mode_copies_in_power_of_two_blocks(example):
    rollout, memory = example.rollout, example.memory
    tensors = [2 * n for n in rollout_model.weight_tensors(GLM52, tp=8, expert_split=64)]
    blocks = [next_power_of_two(a) for a in rollout_model.allocations(tensors)]
    assert rollout.sleep_level == 1  # verl on NPU
    assert rollout.host_bytes_per_rank == sum(blocks) and rollout.weights_bytes == sum(
        rollout_model.allocations(tensors)
    )
    assert 1.2 < rollout.host_bytes_per_rank / rollout.weights_bytes < 2  # the experts' 201 MB blocks take 256 MB
    assert memory.rollout_host_bytes_per_node == 16 * rollout.host_bytes_per_rank
    assert memory.node_host_bytes == memory.host_bytes_per_node + memory.rollout_host_bytes_per_node
    (fits,) = checks(example, "memory.fits")
    assert "of the rollout's sleep-mode weight copies" in fits.detail


def test_host_ram_for_the_offloaded_actor_alone_is_no_longer_enough(example):
    from verl_npu.preflight.memory import Offload
    from verl_npu.preflight.memory_plan import memory_checks

    memory = example.memory
    node = dataclasses.replace(memory, host_capacity_bytes=memory.host_bytes_per_node + 50 * GiB)
    found = memory_checks(node, Offload(param_offload=True, optimizer_offload=True), "a3")
    (host,) = [c for c in found if c.check == "memory.host"]
    assert host.status == FAIL and "rollout's sleep-mode weight copies" in host.detail and node.fits is False
    assert json.loads(json.dumps(example.to_dict(), default=str))["rollout"]["host_bytes_per_node"] > 0


def test_level_2_sleep_and_no_sleep_copy_nothing():
    assert rollout_model.estimate(GLM52, EXAMPLE_ROLLOUT, 64 * GiB, 16, platform="cuda").host_bytes_per_rank == 0
    awake = dataclasses.replace(EXAMPLE_ROLLOUT, free_cache_engine=False)
    assert rollout_model.estimate(GLM52, awake, 64 * GiB, 16).sleep_level == 0
