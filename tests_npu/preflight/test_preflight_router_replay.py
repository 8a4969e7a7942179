"""Preflight's routing-replay checks (verl_npu/preflight/router_replay.py) on the GLM-5.2 example launch, and the
vllm-ascend route capture they rely on, executed.

Part 1 runs the real preflight on examples/glm5_2/run_glm5_2_grpo_a3.sh with each case as extra overrides (or an
edited copy of its env file) and asserts on the verdict and the message.

Part 2 (network + ascend_sim) executes vLLM 0.23.0 and vllm-ascend 0.23.0, from their PyPI sdists, on the CPU in a
fresh interpreter, the way tests_npu/support/vllm_cpu.py runs them (its stand-ins for torch_npu, CANN and NPU memory).
What runs for real: vLLM building the scaled GLM-5.2 with vllm-ascend's layers and ``enable_return_routed_experts``;
vLLM's ``RoutedExpertsCapturer``; vllm-ascend's ``NPUModelRunner._bind_routed_experts_capturer`` (taken from its
file: the module's imports need numba, which the dev venv lacks, and the method reads nothing but the compilation
config); ``AscendUnquantizedFusedMoEMethod.apply`` (where the capture is); vllm-ascend's all-to-all token split; the
capture in force with and without verl's GLM-5.2 patch. What stands in, each because it needs an NPU or more ranks:

* ``torch.ops._C_ascend.moe_gating_top_k``, vllm-ascend's compiled gating kernel: the DeepSeek-V3 ``noaux_tc`` rule
  for one expert group (sigmoid scores, experts chosen by score + correction bias, weights from the unbiased scores,
  renormalised and scaled), the case GLM-5.2 takes;
* the expert computation (vllm-ascend's MoE communication method's ``fused_experts``, NPU kernels): records the
  ``topk_ids`` it receives and returns zeros;
* for the multi-rank cases, the other ranks: vLLM's DP metadata of a DP-8 step, and ``torch.distributed.all_gather``
  over a TP group of 8, filling each rank's slice from the whole step's routes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import vllm_cpu
from support.paths import REPO

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.preflight import run_preflight

TESTS = REPO / "tests_npu"
EXAMPLE = REPO / "examples" / "glm5_2"
LAUNCH = EXAMPLE / "run_glm5_2_grpo_a3.sh"
MEGATRON = "actor_rollout_ref.actor.megatron"
MODE = f"{MEGATRON}.router_replay.mode"
ROUTES = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
ROLLOUT = "actor_rollout_ref.rollout"
R3 = (f"{MODE}=R3", f"{ROUTES}=True")
GLM52_PATCH = "VERL_VLLM_ASCEND_GLM52_PATCH"


def replay_checks(report, name: str | None = None):
    return [c for c in report.checks if c.check.startswith("router-replay") and (name is None or c.check == name)]


def one(report, name: str):
    (check,) = replay_checks(report, name)
    return check


def example_copy(tmp_path: Path, env_edit: tuple[str, str]) -> Path:
    target = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, target)
    env = target / "glm5_2.env"
    text = env.read_text()
    assert text.count(env_edit[0]) == 1, env_edit[0]
    env.write_text(text.replace(*env_edit))
    return target / LAUNCH.name


def test_nothing_is_reported_while_replay_is_off_everywhere():
    from verl_npu.preflight.router_replay import router_replay_checks

    moe = {"n_routed_experts": 256, "num_experts_per_tok": 8}
    off = {"actor_rollout_ref": {"actor": {"megatron": {"router_replay": {"mode": "disabled"}}}}}
    assert router_replay_checks(off, moe, {}) == router_replay_checks({}, moe, {}) == []


# --- part 1: the real preflight on the example ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def r3_example():
    return run_preflight(LAUNCH, R3, host_memory_gib=1500)


def test_r3_on_the_example_is_go_and_names_the_capture_path(r3_example):
    assert r3_example.verdict == "go", [c for c in r3_example.checks if c.status == FAIL]
    assert one(r3_example, "router-replay.rollout-routes").status == OK
    rollout = one(r3_example, "router-replay.rollout")
    assert rollout.status == OK
    for named in ("TP 8, DP 8, EP 64", "enable_return_routed_experts", "vllm_ascend/worker/model_runner_v1.py",
                  "vllm_ascend/ops/fused_moe/fused_moe.py", "vllm-ascend's capturer", f"{GLM52_PATCH}=1",
                  "[prompt + response - 1, layers, top-k]"):  # fmt: skip
        assert named in rollout.detail, named


def test_r3_without_the_rollouts_routes_is_no_go_naming_both_keys_and_the_fix():
    """With the actor padding R3 refuses as well: both reported in the one run."""
    report = run_preflight(
        LAUNCH, (f"{MODE}=R3", f"{MEGATRON}.pad_to_length=True", f"{MEGATRON}.use_remove_padding=True"),
        host_memory_gib=1500,
    )  # fmt: skip
    assert report.verdict == "no-go"
    check = one(report, "router-replay.rollout-routes")
    assert check.status == FAIL
    assert f"{MODE}=R3 with {ROUTES}=False" in check.detail
    assert "micro_batch has no routed_experts" in check.detail
    assert check.fix.startswith(f"add {ROUTES}=True")
    assert replay_checks(report, "router-replay.rollout") == []  # the rollout is not asked for routes at all
    padding = one(report, "router-replay.padding")
    assert padding.status == FAIL and "pad_to_length is not supported with router replay" in padding.detail
    assert padding.fix == f"set {MEGATRON}.pad_to_length=False"


def test_routes_without_replay_and_replay_modes_on_ref_and_critic_are_warnings():
    report = run_preflight(
        LAUNCH,
        (
            f"{ROUTES}=True",
            "actor_rollout_ref.ref.megatron.router_replay.mode=R3",
            "critic.megatron.router_replay.mode=R2",
        ),
        host_memory_gib=1500,
    )
    assert report.verdict == "go", [c for c in report.checks if c.status == FAIL]
    routes = one(report, "router-replay.rollout-routes")
    assert routes.status == WARN and "no actor pass reads them" in routes.detail
    ignored = replay_checks(report, "router-replay.ignored")
    assert [c.status for c in ignored] == [WARN, WARN]
    assert ignored[0].detail.startswith("actor_rollout_ref.ref.megatron.router_replay.mode=R3: verl 0.9.1 ignores it")
    assert ignored[1].detail.startswith("critic.megatron.router_replay.mode=R2: verl 0.9.1 ignores it")
    assert all("verl/workers/engine_workers.py" in c.detail for c in ignored)


def test_r2_with_the_rollouts_routes_and_replay_on_a_model_without_routed_experts_are_no_go(tmp_path):
    dense = tmp_path / "dense" / "config.json"
    dense.parent.mkdir()
    dense.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 65536,
    }))  # fmt: skip
    report = run_preflight(LAUNCH, (f"{MODE}=R2", f"{ROUTES}=True"), model_config=str(dense), host_memory_gib=1500)
    assert report.verdict == "no-go"
    pairing = one(report, "router-replay.rollout-routes")
    assert pairing.status == FAIL and f"{MODE}=R2 with {ROUTES}=True" in pairing.detail
    assert "records R2 routes only when the batch carries none" in pairing.detail
    assert f"set {ROUTES}=False" in pairing.fix and f"set {MODE}=R3" in pairing.fix
    model = one(report, "router-replay.model")
    assert model.status == FAIL and "without routed experts" in model.detail
    assert model.fix.startswith(f"set {MODE}=disabled")
    # the rollout's routes alone: vLLM's capturer raises at engine start on a model without experts
    report = run_preflight(LAUNCH, (f"{ROUTES}=True",), model_config=str(dense), host_memory_gib=1500)
    assert report.verdict == "no-go"
    model = one(report, "router-replay.model")
    assert model.status == FAIL and "capturer raises at engine start" in model.detail
    assert model.fix == f"set {ROUTES}=False: routing replay is for MoE models"


def test_bad_values_are_each_a_clear_error_in_one_run():
    report = run_preflight(LAUNCH, (f"{MODE}=r3", f"{ROUTES}=maybe"), host_memory_gib=1500)
    assert report.verdict == "no-go"
    details = {c.detail: c.fix for c in replay_checks(report, "router-replay.value")}
    assert details == {
        f"{MODE}='r3': expected one of R2, R3, disabled": f"set {MODE} to one of disabled, R2, R3 (verl compares "
        "the text exactly)",
        f"{ROUTES}='maybe': expected true or false": f"set {ROUTES} to True or False",
    }
    assert not [c for c in replay_checks(report) if c.check != "router-replay.value"]  # nothing judged on them


@pytest.mark.parametrize("name", ["trtllm", "sglang"])
def test_r3_with_a_rollout_other_than_vllm_is_never_go(name):
    report = run_preflight(LAUNCH, (*R3, f"{ROLLOUT}.name={name}"), host_memory_gib=1500)
    check = one(report, "router-replay.rollout")
    assert f"{ROLLOUT}.name={name}" in check.detail
    if name == "trtllm":  # verl asks it for no routes
        assert check.status == FAIL and report.verdict == "no-go"
        assert "verl/workers/rollout/vllm_rollout/vllm_async_server.py" in check.detail
        assert check.fix == f"set {ROLLOUT}.name=vllm (the verl-npu stack's rollout)"
    else:  # verl asks it, the verl-npu stack does not ship it
        assert check.status == WARN and "not checked" in check.detail


def test_r3_with_a_quantized_rollout_or_one_tp_slice_per_rank_is_no_go():
    """DP 1 with TP 8 x EP 8: each TP rank routes its slice and nothing gathers them; fp8: no capture at all."""
    report = run_preflight(
        LAUNCH,
        (*R3, f"{ROLLOUT}.data_parallel_size=1", f"{ROLLOUT}.expert_parallel_size=8", f"{ROLLOUT}.quantization=fp8"),
        host_memory_gib=1500,
    )
    assert report.verdict == "no-go"
    quantized, split = replay_checks(report, "router-replay.rollout")
    assert quantized.status == FAIL and f"{ROLLOUT}.quantization=fp8" in quantized.detail
    assert "AscendUnquantizedFusedMoEMethod.apply" in quantized.detail and "expert 0" in quantized.detail
    assert split.status == FAIL and "rollout TP 8, DP 1 and EP 8" in split.detail
    assert "vllm_ascend/ops/fused_moe/prepare_finalize.py" in split.detail
    assert f"{ROLLOUT}.data_parallel_size > 1" in split.fix


def test_r3_without_verls_glm52_patch_is_no_go_on_ascend(tmp_path):
    launch = example_copy(tmp_path, (f"{GLM52_PATCH}=1", f"{GLM52_PATCH}=0"))
    report = run_preflight(launch, R3, host_memory_gib=1500)
    assert report.verdict == "no-go"
    check = one(report, "router-replay.rollout")
    assert check.status == FAIL and f"{GLM52_PATCH}=0" in check.detail
    assert "unexpected topk_ids batch dim" in check.detail
    assert "vllm_ascend/patch/worker/patch_routed_experts_capture.py" in check.detail
    assert check.fix == f"set {GLM52_PATCH}=1 in the launch's env file"


# --- part 2: the route capture of vLLM 0.23.0 + vllm-ascend 0.23.0, executed on the CPU -----------------------------
SCALED_LAYERS = vllm_cpu.SCALED_LAYERS  # layers 0-2 dense, 3-7 MoE (4 experts, top-2)
STEP_TOKENS, TP, DP_TOKENS = 16, 8, 13


def _scaled_config(directory: Path) -> Path:
    from transformers import GlmMoeDsaConfig

    GlmMoeDsaConfig(**vllm_cpu.SCALED_GLM5_2).save_pretrained(directory)  # no weights: vLLM loads load_format="dummy"
    return directory


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict:
    """The rollout side run twice, side by side: with the example's environment (verl's GLM-5.2 patch on) and
    without the patch."""
    from verl_npu.envfile import env_file_variables

    sources = vllm_cpu.sources()
    work = tmp_path_factory.mktemp("routes")
    checkpoint = str(_scaled_config(work / "glm5_2_scaled"))
    example_value = env_file_variables(str(EXAMPLE / "glm5_2.env"))[GLM52_PATCH]
    runs = {"example": {GLM52_PATCH: example_value}, "without-glm52-patch": {GLM52_PATCH: "0"}}
    started = {}
    for name, env in runs.items():
        out = work / name
        out.mkdir()
        request = {"checkpoint": checkpoint, "env": env, "packages": str(sources.packages), "out": str(out)}
        (out / "request.json").write_text(json.dumps(request))
        environment = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
        environment.update(PYTHONPATH=os.pathsep.join(map(str, (TESTS, sources.vllm, sources.vllm_ascend))),
                           VLLM_CACHE_ROOT=str(out / "vllm-cache"), VLLM_LOGGING_LEVEL="WARNING",
                           VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")  # fmt: skip
        command = [sys.executable, "-m", Path(__file__).stem, str(out / "request.json")]
        with (out / "rollout.log").open("w") as log:  # the child keeps its own descriptor
            started[name] = subprocess.Popen(
                command, cwd=Path(__file__).parent, env=environment, stdout=log, stderr=subprocess.STDOUT
            )
    return {name: vllm_cpu.collect(process, work / name) for name, process in started.items()}


@pytest.mark.parametrize("run", ["example", "without-glm52-patch"])
@pytest.mark.network
@pytest.mark.ascend_sim
def test_vllm_ascend_hands_the_capturer_to_every_moe_layer_and_records_what_the_experts_receive(captured, run):
    result = captured[run]
    assert result["platform"] == "NPUPlatform"
    assert result["buffer_shape"] == [STEP_TOKENS, SCALED_LAYERS, 2]  # [tokens of a step, num_hidden_layers, top-k]
    layers = result["moe_layers"]
    assert sorted(layers) == [f"model.layers.{i}.mlp.experts" for i in range(3, SCALED_LAYERS)]
    for name, layer in layers.items():
        assert layer == {
            "class": "vllm_ascend.ops.fused_moe.fused_moe.AscendFusedMoE",
            "method": "AscendUnquantizedFusedMoEMethod",
            "layer_id": int(name.split(".")[2]),
            "capturer_bound": True,
        }, name
    routes, received = result["step"]["buffer"], result["step"]["received"]
    for layer in range(SCALED_LAYERS):
        rows = [row[layer] for row in routes]
        if layer < 3:
            assert rows == [[0, 0]] * STEP_TOKENS, f"dense layer {layer}"
        else:
            assert rows[:5] == received[str(layer)], f"layer {layer}: routes differ from what the experts got"
            assert rows[5:] == [[0, 0]] * (STEP_TOKENS - 5)  # rows past the step's tokens stay cleared
            assert all(a != b for a, b in received[str(layer)])  # genuine top-2 routes, not the cleared [0, 0]


@pytest.mark.network
@pytest.mark.ascend_sim
def test_the_capture_in_force_is_vllm_ascends_only_with_verls_glm52_patch(captured):
    assert captured["example"]["capture"] == "vllm_ascend.patch.worker.patch_routed_experts_capture"
    assert captured["without-glm52-patch"]["capture"] == "vllm.model_executor.layers.fused_moe.routed_experts_capturer"


@pytest.mark.network
@pytest.mark.ascend_sim
def test_with_dp_1_a_tp_rank_records_only_its_slice_of_the_step(captured):
    """TP rank 0 of 8, DP 1, all-to-all MoE: vllm-ascend routes 2 of the step's 16 tokens there; 14 rows stay 0."""
    for run in ("example", "without-glm52-patch"):
        split = captured[run]["tp_split"]
        assert split["routed_rows"] == STEP_TOKENS // TP == 2
        assert split["buffer"][:2] == split["received"]
        assert split["buffer"][2:] == [[0, 0]] * (STEP_TOKENS - 2)


@pytest.mark.network
@pytest.mark.ascend_sim
def test_under_dp_an_uneven_all_to_all_slice_is_gathered_only_by_vllm_ascends_capture(captured):
    """13 tokens over TP 8 give TP ranks 5-7 one row each: vLLM's capture refuses that rank, vllm-ascend's gathers
    all 13 rows of the step."""
    upstream = captured["without-glm52-patch"]["uneven_slice"]
    assert upstream["error"].startswith("AssertionError: RoutedExpertsCapturer: unexpected topk_ids batch dim 1")
    ascend = captured["example"]["uneven_slice"]
    assert ascend["error"] is None
    assert ascend["buffer"] == ascend["whole_step"] and len(ascend["whole_step"]) == DP_TOKENS


# --- the rollout side: runs in its own interpreter (python -m test_preflight_router_replay REQUEST.json) -------------
def _gating_kernel_stand_in(x, *, k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                            routed_scaling_factor=1.0, eps=1e-20, bias_opt=None):  # fmt: skip
    """Stands in for vllm-ascend's compiled ``moe_gating_top_k`` in the one case it covers (see the docstring)."""
    import torch

    assert group_count == 1 and k_group == 1 and norm_type == 1, "the stand-in covers sigmoid, one expert group"
    scores = x.float().sigmoid()
    chosen = (scores + (0 if bias_opt is None else bias_opt.float())).topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return (weights * routed_scaling_factor).to(x.dtype), chosen.to(torch.int32), scores


class _ExpertKernelsStandIn:
    """The MoE communication method's expert computation (NPU kernels): records the routes it is handed."""

    def __init__(self) -> None:
        self.received = None

    def fused_experts(self, fused_experts_input):
        self.received = fused_experts_input.topk_ids.clone()
        return fused_experts_input.hidden_states * 0


def _bind_from_vllm_ascend():
    """``NPUModelRunner._bind_routed_experts_capturer``, compiled from vllm-ascend's file (see the docstring)."""
    import ast

    import vllm_ascend
    from vllm_ascend.utils import vllm_version_is

    path = Path(vllm_ascend.__file__).parent / "worker" / "model_runner_v1.py"
    (runner,) = [n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == "NPUModelRunner"]
    (bind,) = [n for n in runner.body if getattr(n, "name", None) == "_bind_routed_experts_capturer"]
    namespace = {"vllm_version_is": vllm_version_is}
    exec(compile(ast.Module([bind], []), str(path), "exec"), namespace)
    return namespace["_bind_routed_experts_capturer"]


def _apply(layer, x, logits):
    """The layer's MoE method with the arguments vllm-ascend's AscendFusedMoE.forward_impl passes it."""
    return layer.quant_method.apply(
        layer=layer, x=x, router_logits=logits, pertoken_scale=None, top_k=layer.top_k, renormalize=layer.renormalize,
        use_grouped_topk=layer.use_grouped_topk, num_experts=layer.moe_config.num_experts,
        expert_map=layer._expert_map, topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
        custom_routing_function=layer.custom_routing_function, scoring_func=layer.scoring_func,
        routed_scaling_factor=layer._original_routed_scaling_factor,
        e_score_correction_bias=layer.e_score_correction_bias, activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input, enable_force_load_balance=False,
        log2phy=layer.log2phy, global_redundant_expert_num=layer.global_redundant_expert_num, mc2_mask=None,
    )  # fmt: skip


def _rollout_side(request: dict) -> dict:
    import types

    import torch

    vllm_cpu._install_stand_ins()
    os.environ.update(request["env"])
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    current_platform.device_type = "cpu"
    registry._run_in_subprocess = lambda inspect: inspect()
    load_general_plugins()
    import verl.workers.rollout.vllm_rollout.utils  # noqa: F401  verl's NPU patches (its GLM-5.2 patch per env)
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX, MoECommType, set_ascend_forward_context
    from vllm_ascend.ops.fused_moe.prepare_finalize import PrepareAndFinalizeWithAll2All

    model_config = ModelConfig(model=request["checkpoint"], dtype="bfloat16", max_model_len=128, enforce_eager=True,
                               skip_tokenizer_init=True, seed=0, enable_return_routed_experts=True)  # fmt: skip
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                        device_config=DeviceConfig("cpu"))  # fmt: skip
    vllm_cpu._start_worker(config)
    vllm_cpu._model(config)
    capturer = RoutedExpertsCapturer(max_num_batched_tokens=STEP_TOKENS, vllm_config=config)
    _bind_from_vllm_ascend()(types.SimpleNamespace(compilation_config=config.compilation_config), capturer)
    layers = {n: m for n, m in config.compilation_config.static_forward_context.items() if isinstance(m, FusedMoE)}
    capture = RoutedExpertsCapturer.capture
    result = {
        "platform": type(current_platform).__name__,
        "capture": getattr(capture, "__module__", None),
        "buffer_shape": list(capturer.device_buffer.shape),
        "moe_layers": {
            name: {
                "class": f"{type(m).__module__}.{type(m).__qualname__}",
                "method": type(m.quant_method).__qualname__,
                "layer_id": m.layer_id,
                "capturer_bound": getattr(m, "_ascend_routed_experts_capturer", None) is capturer,
            }
            for name, m in layers.items()
        },
    }
    torch.ops._C_ascend.moe_gating_top_k = _gating_kernel_stand_in
    experts = _ExpertKernelsStandIn()
    generator = torch.Generator().manual_seed(0)

    def inputs(tokens):
        return torch.randn(tokens, 64, generator=generator).bfloat16(), torch.randn(tokens, 4, generator=generator)

    # one step of 5 tokens through every MoE layer, DP 1 (as a rank of a TP 1 rollout sees it)
    capturer.clear_buffer()
    received = {}
    with set_ascend_forward_context(None, config, num_tokens=5):
        _EXTRA_CTX.moe_comm_method = experts
        for m in layers.values():
            _apply(m, *inputs(5))
            received[str(m.layer_id)] = experts.received.tolist()
    result["step"] = {"buffer": capturer.get_device_buffer().tolist(), "received": received}

    # TP rank 0 of 8, DP 1: vllm-ascend's all-to-all split gives the rank its slice before routing
    layer = next(iter(layers.values()))
    split = PrepareAndFinalizeWithAll2All.__new__(PrepareAndFinalizeWithAll2All)
    split.tp_size, split.tp_rank = TP, 0  # what _restore_tp_across_dp reads on rank 0 of a TP-8 group
    capturer.clear_buffer()
    with set_ascend_forward_context(None, config, num_tokens=STEP_TOKENS):
        _EXTRA_CTX.moe_comm_method = experts
        prepared = split.prepare(*inputs(STEP_TOKENS))
        _apply(layer, prepared.hidden_states, prepared.router_logits)
    result["tp_split"] = {
        "routed_rows": prepared.hidden_states.shape[0],
        "buffer": capturer.get_device_buffer()[:, layer.layer_id].tolist(),
        "received": experts.received.tolist(),
    }

    # DP 8 x TP 8, a step of 13 tokens per DP rank: TP rank 5 holds one row of the all-to-all split
    whole = torch.randint(0, 4, (DP_TOKENS, 2), generator=generator, dtype=torch.int32)
    slices = torch.tensor_split(whole, TP)

    def all_gather_of_tp_8(tensor_list, tensor, group=None, async_op=False):
        assert torch.equal(tensor, slices[5]) and len(tensor_list) == TP
        for out, part in zip(tensor_list, slices, strict=True):
            out.copy_(part)

    capturer.clear_buffer()
    capturer.tp_size = TP
    gather, torch.distributed.all_gather = torch.distributed.all_gather, all_gather_of_tp_8
    try:
        with set_ascend_forward_context(None, config, num_tokens=DP_TOKENS):
            # what a prefill step of an expert-parallel rollout has: DP metadata and the all-to-all MoE
            get_forward_context().dp_metadata = types.SimpleNamespace(
                num_tokens_across_dp_cpu=torch.full((8,), DP_TOKENS, dtype=torch.int32)
            )
            _EXTRA_CTX.moe_comm_type = MoECommType.ALLTOALL
            capturer.capture(layer_id=layer.layer_id, topk_ids=slices[5].clone())
        error = None
    except Exception as exc:  # vLLM's own capture refuses this slice
        error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.distributed.all_gather = gather
    result["uneven_slice"] = {
        "error": error,
        "buffer": capturer.get_device_buffer()[:DP_TOKENS, layer.layer_id].tolist(),
        "whole_step": whole.tolist(),
    }
    return result


def main(argv: list[str]) -> int:
    import site

    request = json.loads(Path(argv[0]).read_text())
    site.addsitedir(request["packages"])  # vLLM's import requirements, after the venv's packages
    result = _rollout_side(request)
    (Path(request["out"]) / "result.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
