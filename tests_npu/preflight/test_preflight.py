"""`verl-npu preflight` on the GLM-5.2 example and on broken variants of it, each with its exact diagnosis."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

from verl_npu.checks import FAIL, OK, WARN
from verl_npu.contracts.vllm_ascend import GLM52_PATCH_VARIABLE
from verl_npu.preflight import run_preflight
from verl_npu.preflight.model import FROM_BESIDE_SCRIPT, FROM_NAME, resolve_model

EXAMPLE = REPO / "examples" / "glm5_2"
LAUNCH = EXAMPLE / "run_glm5_2_grpo_a3.sh"


def variant(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """A copy of the example (script + env file) with each ``old -> new`` edit applied exactly once."""
    target = tmp_path / "glm5_2"
    shutil.copytree(EXAMPLE, target)
    script = target / LAUNCH.name
    text = script.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} must occur once in the example"
        text = text.replace(old, new)
    script.write_text(text)
    return script


def failures(report) -> list[tuple[str, str, str]]:
    return [(c.area, c.name, c.detail) for c in report.checks if c.status == FAIL]


def edit_env(script: Path, old: str, new: str) -> None:
    """Apply ``old -> new`` once to the env file the (copied) example sources."""
    env = script.parent / "glm5_2.env"
    text = env.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in the env file"
    env.write_text(text.replace(old, new))


def without_glm52_patch(script: Path) -> None:
    """The copied env file without VERL_VLLM_ASCEND_GLM52_PATCH (whether or not the example sets it yet)."""
    env = script.parent / "glm5_2.env"
    lines = env.read_text().splitlines(keepends=True)
    env.write_text("".join(line for line in lines if not line.startswith(GLM52_PATCH_VARIABLE + "=")))


def test_the_glm5_2_example_is_go_with_per_stage_hbm_and_per_node_host_ram():
    report = run_preflight(LAUNCH)
    assert report.verdict == "go", failures(report)
    memory = report.memory
    assert [s.layers for s in memory.stages] == [9, 10, 10, 10, 10, 10, 10, 9]
    assert memory.capacity_bytes == 64 * 2**30  # A3 HBM per NPU, from the stack manifest
    for stage in memory.stages:
        assert 0 < stage.train_bytes <= memory.capacity_bytes
        assert memory.rollout_bytes(stage) <= memory.capacity_bytes
        assert stage.host_bytes > 0  # param and optimizer offload put state in host RAM
    assert memory.host_bytes_per_node == max(
        sum(memory.stages[s].host_bytes for s in node) for node in _node_stages(memory)
    )
    names = {c.name for c in report.checks}
    assert {"actor-build-plan", "actor-mesh", "rollout-mesh", "batch", "fits"} <= names
    plan = next(c for c in report.checks if c.name == "actor-build-plan").detail
    for feature in ("dsa_absorbed_mla", "dsa_fused_operators", "dsa_cp_kvallgather", "param_offload",
                    "optimizer_offload", "precision_aware"):  # fmt: skip
        assert feature in plan
    # what MindSpeed will really do with the launch, as the engine applies it
    notes = [c.detail for c in report.checks if c.name == "actor-build-plan"]
    for said in ("MLASelfAttentionAbsorb replaces linear_kv_up_proj", "kv-allgather CP gathers the keys",
                 "also at dsa_indexer_loss_coeff=0"):  # fmt: skip
        assert any(said in n for n in notes), said
    assert not [c for c in report.checks if c.status == WARN and c.area == "engine"]
    # GLM-5.2's real architecture, from the config.json beside the script (/models/GLM-5.2 is not on this machine)
    (model,) = [c for c in report.checks if c.name == "model"]
    assert model.status == OK and f"model config from {EXAMPLE / 'config.json'} (beside the launch script)" in (
        model.detail
    )
    assert report.model_origin == FROM_BESIDE_SCRIPT
    assert len(report.model["dsa_indexers"]["full"]) == 21 and len(report.model["dsa_indexers"]["shared"]) == 57
    assert "dsa_index_share" in plan
    bridge = [c.detail for c in report.checks if c.name == "model-bridge" and c.status == OK]
    assert "IndexShare: 21 full / 57 shared DSA layers" in bridge[0]
    assert bridge[1:] == [
        "stage 0: layers 0-8, full 0, 1, 2, 6",
        "stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0)",
        "stage 2: layers 19-28, full 22, 26; starts shared (carry from stage 1)",
        "stage 3: layers 29-38, full 30, 34, 38; starts shared (carry from stage 2)",
        "stage 4: layers 39-48, full 42, 46; starts shared (carry from stage 3)",
        "stage 5: layers 49-58, full 50, 54, 58; starts shared (carry from stage 4)",
        "stage 6: layers 59-68, full 62, 66; starts shared (carry from stage 5)",
        "stage 7: layers 69-77, full 70, 74; starts shared (carry from stage 6)",
    ]
    # the rollout: verl's GLM-5.2 patch is on in the env file (set by the example; the variants below remove it)
    (patch,) = [c for c in report.checks if c.name == "glm52-patch"]
    assert patch.status == OK and f"{GLM52_PATCH_VARIABLE}=1" in patch.detail
    # the top-k carry: kept on the device by the one-layer recompute chunks that start shared (stage 0: layers 2
    # and 6's; the others: the received one and two full layers'), and sent at every stage boundary
    topk = 8 * (32768 // 4) * 2048  # int64 [b, s/CP, k]
    for stage, kept in zip(memory.stages, [2, 3, 3, 3, 3, 3, 3, 3], strict=True):
        share = stage.index_share
        assert stage.train["carry"] == min(8 - stage.stage, 64) * kept * topk
        assert share.send_bytes_per_microbatch == (24 + topk // 2 if stage.stage < 7 else 0)


def _node_stages(memory) -> list[list[int]]:
    # 16 NPUs per node over ranks laid out with PP outermost: 64 ranks per stage = 4 nodes per stage
    return [[n // 4] * 16 for n in range(32)]


@pytest.mark.parametrize(
    ("edits", "area", "name", "message"),
    [
        pytest.param(
            [
                (
                    "    $MEGATRON.param_offload=True \\\n",
                    "    $MEGATRON.param_offload=True \\\n    $MEGATRON.grad_offload=True \\\n",
                )
            ],
            "config",
            "removed-key",
            "verl removed megatron.grad_offload (2026-08): param_offload=True now also releases the gradient buffers",
            id="grad_offload-key",
        ),
        pytest.param(
            [("actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ration_low=0.2")],
            "config",
            "unknown-key",
            "did you mean 'actor_rollout_ref.actor.clip_ratio_low'?",
            id="misspelled-key",
        ),
        pytest.param(
            [
                (
                    '    trainer.val_before_train=False \\\n    "$@"',
                    '    trainer.val_before_train=False | tee train.log "$@"',
                )
            ],
            "launch",
            "args-to-tee",
            "tee",
            id="args-into-tee",
        ),
        pytest.param(
            [("TRAIN_EP=64", "TRAIN_EP=48")],
            "mesh",
            "actor-ep",
            "world size 512 is not divisible by PP 8 x EP 48 x ETP 1 = 384 (the expert-parallel group)",
            id="ep-does-not-divide",
        ),
        pytest.param(
            [("FIRST_STAGE_LAYERS=9", "FIRST_STAGE_LAYERS=8")],
            "mesh",
            "actor-pp-layers",
            "78 layers - 8 (first stage) - 9 (last stage) = 61 over 6 stages do not split evenly",
            id="pp-does-not-divide-layers",
        ),
        pytest.param(
            [("TRAIN_TP=2 ", "TRAIN_TP=1 ")],
            "mesh",
            "actor-sp",
            "sequence_parallel=True needs tensor_model_parallel_size > 1",
            id="sp-with-tp1",
        ),
        pytest.param(
            [("    +$TRANSFORMER.use_fused_lightning_indexer_kl_loss=True \\\n", "")],
            "engine",
            "actor-build-plan",
            "MindSpeed's four DSA switches (use_dsa_absorb, use_fused_lightning_indexer, "
            "use_fused_sparse_flash_attention, use_fused_lightning_indexer_kl_loss) go on or off together",
            id="dsa-fused-flags-partial",
        ),
        pytest.param(
            [("    +$TRANSFORMER.use_dsa_absorb=True \\\n", "")],
            "engine",
            "actor-build-plan",
            "also set override_transformer_config.use_dsa_absorb=True",
            id="dsa-fused-without-absorption",
        ),
        pytest.param(
            [("TRAIN_TP=2 ", "TRAIN_TP=3 ")],
            "engine",
            "actor-build-plan",
            "npu_sparse_flash_attention takes (1, 2, 4, 8, 16, 32, 64, 128) query heads per device",
            id="fused-dsa-heads-per-device",
        ),
        pytest.param(
            [("data.train_batch_size=64", "data.train_batch_size=48")],
            "mesh",
            "batch-mini",
            "data.train_batch_size 48 is not divisible by actor.ppo_mini_batch_size 32",
            id="batch-does-not-divide",
        ),
        pytest.param(
            [("    $MEGATRON.param_offload=True \\\n    $MEGATRON.optimizer_offload=True \\\n", "")],
            "memory",
            "stage1-rollout",
            "enable megatron.param_offload and megatron.optimizer_offload",
            id="exceeds-hbm-without-offload",
        ),
        pytest.param(
            [("TRAIN_FILES=", "TRAIN_FILE=")],
            "launch",
            "unset-variable",
            "TRAIN_FILES",
            id="unset-variable",
        ),
        pytest.param(
            [
                ("FIRST_STAGE_LAYERS=9 LAST_STAGE_LAYERS=9", "FIRST_STAGE_LAYERS=10 LAST_STAGE_LAYERS=8"),
                (
                    "    $MEGATRON.use_distributed_optimizer=True \\\n",
                    "    $MEGATRON.use_distributed_optimizer=True \\\n"
                    "    $MEGATRON.virtual_pipeline_model_parallel_size=2 \\\n",
                ),
            ],
            "engine",
            "actor-build-plan",
            # chunks of 5 layers (4 on the last stage): stage 1's first chunk starts at shared layer 5
            "stage 1 chunk 0 (layers 5-9) starts on shared layer 5; ",
            id="vpp-chunk-starts-shared",
        ),
        pytest.param(
            [
                (
                    "    actor_rollout_ref.rollout.name=vllm \\\n",
                    "    actor_rollout_ref.rollout.name=vllm \\\n    actor_rollout_ref.model.mtp.enable=True \\\n"
                    "    actor_rollout_ref.model.mtp.enable_rollout=True \\\n",
                )
            ],
            "config",
            "rollout-mtp",
            "verl-npu's GLM-5 bridge builds no MTP layers, so verl's weight sync sends none and under "
            "load_format='dummy' (verl's default) the draft head stays random",
            id="rollout-mtp-on",
        ),
        pytest.param(
            [('"$PYTHON" -m verl.trainer.main_ppo', '"$PYTHON" -m verl.trainer.main_ppo_typo')],
            "launch",
            "no-trainer",
            "verl.trainer.main_ppo",
            id="trainer-never-invoked",
        ),
    ],
)
def test_broken_variant_gets_its_exact_diagnosis(tmp_path, edits, area, name, message):
    if area == "launch" and name == "unset-variable":  # the edit is in the env file, not the script
        script = variant(tmp_path)
        env = script.parent / "glm5_2.env"
        env.write_text(env.read_text().replace(*edits[0]))
    else:
        script = variant(tmp_path, *edits)
    report = run_preflight(script)
    assert report.verdict == "no-go"
    matching = [f for f in failures(report) if f[0] == area and f[1] == name]
    assert matching, f"expected a failed {area}/{name} check, got {failures(report)}"
    assert any(message in f[2] for f in matching), matching


@pytest.mark.parametrize(
    ("edit", "name", "message"),
    [
        pytest.param(
            without_glm52_patch,
            "glm52-patch",
            f"{GLM52_PATCH_VARIABLE} is not set in the launch's environment: verl 0.9.1 ships vllm-ascend 0.23's "
            "fixes for GLM-5.2 RL weight updates",
            id="glm52-patch-missing",
        ),
        pytest.param(
            lambda script: (
                without_glm52_patch(script),
                edit_env(script, "NNODES=32\n", f"NNODES=32\n{GLM52_PATCH_VARIABLE}=0\n"),
            ),
            "glm52-patch",
            f"{GLM52_PATCH_VARIABLE}='0' in the launch's environment",
            id="glm52-patch-off",
        ),
        pytest.param(
            lambda script: edit_env(script, "MODEL_PATH=/models/GLM-5.2\n", "MODEL_PATH=/models/GLM-5.2-FP8\n"),
            "rollout-fp8",
            "its name says FP8 (the config preflight used is a stand-in: /models/GLM-5.2-FP8 is not on this machine)",
            id="fp8-model-path",
        ),
    ],
)
def test_a_rollout_the_env_file_or_model_path_cannot_serve_is_no_go(tmp_path, edit, name, message):
    script = variant(tmp_path)
    edit(script)
    report = run_preflight(script)
    assert report.verdict == "no-go"
    matching = [f for f in failures(report) if f[1] == name]
    assert len(matching) == 1 and message in matching[0][2], failures(report)
    assert [f[1] for f in failures(report)] == [name]  # nothing else is wrong with the launch
    assert "Instead:" in matching[0][2]


def test_an_fp8_checkpoint_config_is_no_go_for_a_vllm_rollout_on_ascend(tmp_path):
    """GLM-5.2-FP8's config.json: e4m3 with 128x128 block scales; vllm-ascend's fp8 is MXFP8 for the 950 only."""
    script = variant(tmp_path)
    config = script.parent / "config.json"
    fp8 = json.loads(config.read_text())
    fp8["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config.write_text(json.dumps(fp8))
    report = run_preflight(script)
    (failed,) = failures(report)
    assert failed[:2] == ("config", "rollout-fp8")
    assert "its config.json has quantization_config.quant_method=fp8" in failed[2]
    assert "SFA attention asserts an unquantised kv_b_proj" in failed[2]
    assert "point actor_rollout_ref.model.path at the BF16 checkpoint" in failed[2]
    cuda = run_preflight(script, platform="cuda")  # not vllm-ascend: nothing to refuse here
    assert not [f for f in failures(cuda) if f[1] == "rollout-fp8"]


def test_expandable_segments_in_the_env_file_stop_a_sleep_mode_rollout(tmp_path):
    """vllm-ascend's CaMemAllocator (vLLM sleep mode, verl's default) asserts PYTORCH_NPU_ALLOC_CONF has no
    expandable segments: the rollout would not start after the job queued."""
    script = variant(tmp_path)
    env = script.parent / "glm5_2.env"
    env.write_text(env.read_text() + "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n")
    report = run_preflight(script)
    assert report.verdict == "no-go"
    (failed,) = [f for f in failures(report) if f[:2] == ("launch", "npu-alloc-conf")]
    assert "CaMemAllocator asserts that it does not contain expandable_segments:True" in failed[2]
    assert "+actor_rollout_ref.rollout.enable_sleep_mode=False" in failed[2]
    off = variant(
        tmp_path / "off",
        (
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.rollout.n=8 \\\n    +actor_rollout_ref.rollout.enable_sleep_mode=False",
        ),
    )
    (off.parent / "glm5_2.env").write_text(env.read_text())
    report_off = run_preflight(off)
    assert report_off.verdict == "go", failures(report_off)  # sleep mode off: vLLM never builds CaMemAllocator


def test_the_same_launch_fits_with_offload_and_not_without():
    """The acceptance pair: only the offload switches differ."""
    with_offload = run_preflight(LAUNCH)
    without = run_preflight(LAUNCH, ["actor_rollout_ref.actor.megatron.param_offload=False",
                                     "actor_rollout_ref.actor.megatron.optimizer_offload=False"])  # fmt: skip
    assert with_offload.memory.fits is True and without.memory.fits is False
    stage = max(without.memory.stages, key=lambda s: s.floor_bytes)
    assert without.memory.rollout_bytes(stage) > without.memory.capacity_bytes
    assert with_offload.memory.stages[stage.stage].train_bytes == stage.train_bytes  # offload moves, not shrinks


def test_overrides_without_a_script_are_checked_the_same_way():
    report = run_preflight(
        None,
        ["--config-name=ppo_megatron_trainer", "actor_rollout_ref.model.path=glm5", "trainer.nnodes=1",
         "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
    )  # fmt: skip
    assert report.verdict == "no-go"
    assert any(f[1] == "actor-dp" and "TP 3" in f[2] for f in failures(report)), failures(report)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "verl_npu.cli", "preflight", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_go_writes_json_and_a_plot(tmp_path):
    done = cli(str(LAUNCH), "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GO" in done.stdout and "HBM per device" in done.stdout and "host RAM" in done.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "go" and len(data["memory"]["stages"]) == 8
    assert data["model_origin"] == FROM_BESIDE_SCRIPT
    stage1 = data["memory"]["stages"][1]
    assert stage1["index_share"]["receives"] and stage1["train"]["carry"] > 0
    assert stage1["dsa_layout"].startswith("stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0)")
    assert "carry" in done.stdout and "top-k sent per micro-batch: 64.0 MiB at 0->1" in " ".join(done.stdout.split())
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "r.png")
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_cli_no_go_exits_1_and_a_missing_script_exits_2(tmp_path):
    script = variant(tmp_path, ("TRAIN_TP=2 ", "TRAIN_TP=1 "))
    done = cli(str(script), "--json", "-")
    assert done.returncode == 1
    assert json.loads(done.stdout)["verdict"] == "no-go"
    missing = cli(str(tmp_path / "absent.sh"))
    assert missing.returncode == 2 and "absent.sh" in missing.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algorithm.adv_estimator=gae"],
        ["algorithm.adv_estimator=grpo", "critic.enable=True"],
        ["actor_rollout_ref.actor.use_kl_loss=True"],
        ["algorithm.use_kl_in_reward=True", "critic.enable=False"],
    ],
)
def test_role_predicates_agree_with_verls_own(overrides):
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    from verl_npu.preflight.compose import compose_config
    from verl_npu.preflight.verl_validation import needs_critic, needs_reference_policy

    config, checks = compose_config("ppo_megatron_trainer", overrides)
    assert config is not None, checks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert needs_critic(config) == need_critic(config)
    assert needs_reference_policy(config) == need_reference_policy(config)


def test_rollout_ep_must_span_tp_times_dp(tmp_path):
    report = run_preflight(variant(tmp_path, ("ROLLOUT_EP=64", "ROLLOUT_EP=32")))
    messages = [f[2] for f in failures(report) if f[1] == "rollout-ep"]
    assert messages and "expert_parallel_size 32 must equal TP 8 x DP 8 = 64" in messages[0]


def test_token_budget_below_the_padded_longest_sequence_fails(tmp_path):
    script = variant(
        tmp_path,
        ("ppo_max_token_len_per_gpu=$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))", "ppo_max_token_len_per_gpu=32760"),
        ("MAX_RESPONSE_LENGTH=$((8 * 1024))", "MAX_RESPONSE_LENGTH=8180"),
    )
    report = run_preflight(script)
    messages = [f[2] for f in failures(report) if f[1] == "actor-thd-alignment"]
    assert messages, failures(report)
    assert "32756-token sequence padded to a multiple of 16 (tp*cp*2) is 32768 tokens" in messages[0]


def test_a_glm5_config_the_bridge_cannot_build_is_no_go(tmp_path):
    """A first layer that is shared has no earlier top-k to reuse: the bridge and the build plan both refuse it.

    (Before IndexShare any shared layer was refused; GLM-5.2-style shared layers now build, see below.)
    """
    from transformers import GlmMoeDsaConfig

    first_shared = GlmMoeDsaConfig(indexer_types=["shared"] + ["full"] * 77)
    first_shared.save_pretrained(tmp_path / "glm")
    report = run_preflight(LAUNCH, model_config=str(tmp_path / "glm"))
    messages = [f[2] for f in failures(report) if f[1] == "model-bridge"]
    assert messages and "indexer_types[0] is 'shared', but the first layer has no earlier layer's top-k" in messages[0]
    plan = [f[2] for f in failures(report) if f[1] == "actor-build-plan"]
    assert plan and plan[0].startswith("actor: indexer_types (model config): indexer_types[0] is 'shared'")
    # every other layer shared (transformers' index_topk_freq=2): IndexShare builds it, and every stage of the
    # example's layout starts on a full layer (9, 19, ..., 69 are odd), so no stage receives a carry
    GlmMoeDsaConfig(index_topk_freq=2).save_pretrained(tmp_path / "freq2")
    report = run_preflight(LAUNCH, model_config=str(tmp_path / "freq2"))
    assert report.verdict == "go", failures(report)
    bridge = [c.detail for c in report.checks if c.name == "model-bridge"]
    assert "IndexShare: 40 full / 38 shared DSA layers" in bridge[0] and "starts shared" not in " ".join(bridge)
    assert not any(s.index_share.receives for s in report.memory.stages)


def test_without_the_model_or_a_config_beside_the_script_a_glm5_2_name_gets_glm5_2s_architecture(tmp_path):
    script = variant(tmp_path)
    (script.parent / "config.json").unlink()
    report = run_preflight(script)
    assert report.verdict == "go", failures(report)
    (model,) = [c for c in report.checks if c.name == "model"]
    assert model.status == WARN and "using GLM-5.2's published architecture" in model.detail
    assert report.model_origin == FROM_NAME and len(report.model["dsa_indexers"]["shared"]) == 57
    glm5 = variant(tmp_path / "glm5")
    (glm5.parent / "config.json").unlink()
    edit_env(glm5, "MODEL_PATH=/models/GLM-5.2\n", "MODEL_PATH=/models/GLM-5\n")
    report = run_preflight(glm5)
    (model,) = [c for c in report.checks if c.name == "model"]
    assert "using GLM-5's shape" in model.detail and report.model["dsa_indexers"]["shared"] == []
    assert any("every layer's DSA indexer is full" in c.detail for c in report.checks if c.name == "model-bridge")


def test_where_the_model_config_comes_from(tmp_path):
    beside = str(EXAMPLE / "config.json")
    hf, check, origin = resolve_model("/models/GLM-5.2", None, beside)
    assert origin == FROM_BESIDE_SCRIPT and check.status == OK and hf["indexer_types"].count("shared") == 57
    assert "/models/GLM-5.2 is not on this machine" in check.detail
    hf, check, origin = resolve_model("/models/glm5_2-bf16", None, None)
    assert origin == FROM_NAME and check.status == WARN and hf["indexer_types"].count("shared") == 57
    hf, check, origin = resolve_model("/models/GLM-5", None, None)
    assert origin == FROM_NAME and "shared" not in hf["indexer_types"]
    hf, check, origin = resolve_model("/models/GLM-5.2", str(EXAMPLE / "config.json"), None)
    assert origin == "model-config" and check.status == OK
    hf, check, origin = resolve_model("/models/Qwen3-8B", None, None)
    assert hf is None and origin is None and check.status == FAIL


def test_a_repeated_check_reuses_the_cached_answer_until_the_model_config_changes(tmp_path, monkeypatch):
    from transformers import GlmMoeDsaConfig

    from verl_npu.preflight import worker

    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    GlmMoeDsaConfig().save_pretrained(tmp_path / "glm")
    first = run_preflight(LAUNCH, model_config=str(tmp_path / "glm"))
    assert first.verdict == "go" and len(list((tmp_path / "cache").rglob("*.json"))) == 1

    from verl_npu.preflight import compose

    asked = []  # the worker starts before the launch is read; on a hit it is ended, never asked
    monkeypatch.setattr(worker.processes, "communicate", lambda *a, **k: asked.append(a) or pytest.fail("worker ran"))
    monkeypatch.setattr(compose, "_compose", lambda *a: pytest.fail("a cached answer composed again"))
    second = run_preflight(LAUNCH, model_config=str(tmp_path / "glm"))
    assert second.to_dict() == first.to_dict() and not asked

    GlmMoeDsaConfig(indexer_types=["shared"] + ["full"] * 77).save_pretrained(tmp_path / "glm")  # same path, new bytes
    monkeypatch.undo()
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    third = run_preflight(LAUNCH, model_config=str(tmp_path / "glm"))
    assert third.verdict == "no-go"


def test_without_the_fused_dsa_operators_the_chunked_dsa_patches_working_set_is_counted():
    """MindSpeed's DSA switches off: verl-npu's dsa-* patches run DSA in query chunks (no [s, s] buffer); still go."""
    from verl_npu.contracts.mindspeed import DSA_SWITCHES
    from verl_npu.ops.chunking import DSA_ATTENTION_CHUNK_ELEMENTS

    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    fused = run_preflight(LAUNCH)
    chunked = run_preflight(LAUNCH, [f"{otc}.{flag}=False" for flag in DSA_SWITCHES])
    assert chunked.verdict == "go", failures(chunked)
    plan = next(c for c in chunked.checks if c.name == "actor-build-plan").detail
    assert "dsa_fused_operators" not in plan and "dsa_absorbed_mla" not in plan and "dsa" in plan
    stages = zip(fused.memory.stages, chunked.memory.stages, strict=True)
    grew = [b.train["activations"] - a.train["activations"] for a, b in stages]
    # one query chunk's working set (four fp32 score-sized tensors at most) in place of the fused operators'
    # saved softmax statistics: a bounded difference, where megatron's dense DSA would add 256 GiB per layer
    assert max(grew) > 0 and all(0 <= g <= 4 * 4 * DSA_ATTENTION_CHUNK_ELEMENTS for g in grew), grew


def test_an_fp8_first_moment_is_no_go_from_verl_and_from_the_build_plan():
    """verl 0.9.1's McoreOptimizerConfig takes fp32 or bf16 moments only; the build plan agrees (it used to take
    fp8, so preflight estimated memory for an engine verl would never start)."""
    fp8 = run_preflight(LAUNCH, ["actor_rollout_ref.actor.optim.exp_avg_dtype=fp8"])
    assert {(area, name) for area, name, _ in failures(fp8)} == {
        ("config", "verl-validation"),
        ("engine", "actor-build-plan"),
    }, failures(fp8)
    assert all("fp8" in detail for _, _, detail in failures(fp8))
    assert fp8.memory is None


def test_the_memory_estimate_runs_the_dsa_kernel_the_build_plan_chose():
    """Switches spelled 1 turn MindSpeed's fused DSA on in the build plan: the estimate counts the fused kernel."""
    from verl_npu.contracts.mindspeed import DSA_SWITCHES

    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    fused = run_preflight(LAUNCH)
    ones = run_preflight(LAUNCH, [f"{otc}.{flag}=1" for flag in DSA_SWITCHES])
    plan = next(c for c in ones.checks if c.name == "actor-build-plan").detail
    assert "dsa_fused_operators" in plan, plan
    assert [s.train for s in ones.memory.stages] == [s.train for s in fused.memory.stages]


def test_a_launch_breaking_several_engine_rules_gets_them_all_in_one_run():
    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    report = run_preflight(
        LAUNCH,
        [
            f"+{otc}.qk_layernorm=False",
            f"+{otc}.apply_rope_fusion=True",
            "actor_rollout_ref.actor.optim.main_grads_dtype=fp16",
            "actor_rollout_ref.actor.optim.exp_avg_sq_dtype=fp64",
        ],
    )
    engine = [message for area, name, message in failures(report) if name == "actor-build-plan"]
    for rule in ("qk_layernorm", "apply_rope_fusion", "main_grads_dtype=fp16", "exp_avg_sq_dtype=fp64"):
        assert any(rule in message for message in engine), (rule, engine)
    assert report.memory is None  # no estimate without the actor's build plan


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: text.replace('"status": "ok"', '"status": "fail"', 1), id="edited"),
        pytest.param(lambda text: "\udcff not json", id="garbage"),
        pytest.param(lambda text: json.dumps({"answer": json.loads(text)["answer"]}), id="no-checksum"),
    ],
)
def test_a_damaged_cache_file_is_never_trusted_and_is_rewritten_whole(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("VERL_NPU_CACHE_DIR", str(tmp_path / "cache"))
    first = run_preflight(LAUNCH)
    (cached,) = (tmp_path / "cache").rglob("*.json")
    cached.write_text(damage(cached.read_text()), errors="surrogateescape")
    again = run_preflight(LAUNCH)
    assert again.to_dict() == first.to_dict()
    from verl_npu.preflight.worker import _unseal

    (rewritten,) = (tmp_path / "cache").rglob("*.json")
    assert _unseal(rewritten.read_text()) is not None  # recomputed by the worker and sealed again
    assert run_preflight(LAUNCH).to_dict() == first.to_dict()
