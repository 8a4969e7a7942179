"""MindSpeed's real code on the CPU (ascend_sim tier): the GLM-5.2 example's actor built as the engine builds it on an
A3 node, and a tiny GLM-5.2 trained through MindSpeed's fused DSA forward.

MindSpeed is the pinned commit with verl-npu's build-time patches applied as install.sh applies them
(verl_npu/upstream.py finds it: $VERL_NPU_MINDSPEED_SRC, else ../shared/upstream/ beside the checkout). Each scenario
runs in its own process (tests_npu/support/ascend_sim_run.py) over the stand-ins of tests_npu/support/ascend_sim.py:
torch_npu's operators, torchair, MegatronAdaptor and TransformerEngineNPU, which cannot exist here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from statistics import median

import pytest
from support.example_launch import compose_example
from support.paths import REPO

from verl_npu import contracts, upstream
from verl_npu.contracts.verify import verify
from verl_npu.models.glm5.config import FULL, indexer_types
from verl_npu.parity.probes import topk_sets

pytestmark = pytest.mark.ascend_sim

RUNNER = REPO / "tests_npu" / "support" / "ascend_sim_run.py"
EXAMPLE_CONFIG = REPO / "examples" / "glm5_2" / "config.json"
CP_ASSERTION = "Currently context parallelism is not supported by DSAttention!"
CP_WRAPPER_FILE = "dsa_kvallgather_context_parallel.py"
# MindSpeed's fused DSA path assigns these targets over verl-npu's patches (contract mindspeed-dsa-patches): its own
# operators run there instead (docs/ascend_contracts.md, "What runs for real on the CPU").
DISPLACED_ON_THE_FUSED_PATH = {"dsa-call-context", "dsa-sparse-attention", "dsa-indexer-topk-eval"}
FUSED_OPERATORS = ["npu_lightning_indexer", "npu_sparse_flash_attention", "npu_sparse_lightning_indexer_grad_kl_loss"]
# The tiny GLM-5.2 of the fused-path runs: parity's fused-shape model (the operators' shapes) with GLM-5.2's first
# four layers (full, full, full, shared) and a 1280-token sequence, so top-k 1024 < sequence for the last 256 rows.
TINY = {"sizes": {"num_hidden_layers": 4}, "shape": {"seq_len": 1280, "batch": 1, "micro_batches": 1}, "steps": 1}
TOPK = 1024


@pytest.fixture(scope="session")
def mindspeed(tmp_path_factory) -> dict[str, Path]:
    source = upstream.locate_mindspeed()
    if source is None:
        pytest.skip(
            f"no MindSpeed source: not at {upstream.default_archive()} and ${upstream.MINDSPEED_SOURCE_ENV} is unset "
            "(verl-npu upstream fetch mindspeed makes the archive where gitcode is reachable)"
        )
    cache = tmp_path_factory.mktemp("mindspeed")
    return {"pristine": upstream.unpacked(source, cache), "installed": upstream.as_installed(source, cache)}


def run_scenario(name: str, inputs: dict, tmp_path: Path, platform: str) -> dict:
    """One scenario of support/ascend_sim_run.py in a fresh interpreter; its observations."""
    source, target = tmp_path / f"{name}.in.json", tmp_path / f"{name}.out.json"
    source.write_text(json.dumps(inputs))
    env = {**os.environ, "VERL_NPU_PLATFORM": platform, "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(RUNNER), name, str(source), str(target)], capture_output=True,
                          text=True, env=env, timeout=1200, check=False)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"ascend_sim scenario {name} failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(target.read_text())


def test_the_source_is_the_pinned_commit(mindspeed):
    """Every recorded MindSpeed fact holds on the source this tier runs (a drifted checkout is not silently used)."""
    results = verify(contracts.ALL, {"mindspeed": mindspeed["pristine"]}, components=["mindspeed"])
    assert results and all(r.ok for r in results), [(r.contract.id, r.detail) for r in results if not r.ok]


# --- the GLM-5.2 example's actor, built as on 32 A3 nodes -----------------------------------------------------------
@pytest.fixture(scope="module")
def engine_build(mindspeed, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("engine-build")
    actor = compose_example(tmp)["actor_rollout_ref"]["actor"]
    inputs = {"mindspeed": str(mindspeed["installed"]), "engine": actor["megatron"], "optim": actor["optim"],
              "hf_config": str(EXAMPLE_CONFIG)}  # fmt: skip
    return run_scenario("engine_build", inputs, tmp, "ascend")


def test_mindspeed_runs_its_whole_default_features_list(engine_build):
    features = engine_build["features_list"]
    assert features == engine_build["default_features_list"] and len(features) > 50
    assert features.index("NpuEnhancementFeature") < features.index("DeepSeekSparseAttention")
    assert {"dsa", "dsa_cp_kvallgather", "dsa_absorbed_mla", "dsa_fused_operators", "dsa_index_share"} <= set(
        engine_build["plan_features"]
    )


def test_mindspeeds_own_repatch_drops_its_dsa_cp_wrapper(engine_build):
    """Finding 1, as MindSpeed composes: without verl-npu's runtime patch the CP 4 config asserts."""
    unpatched = engine_build["without_cp_patch"]
    assert CP_ASSERTION in unpatched.get("error", ""), unpatched
    assert not any(CP_WRAPPER_FILE in step for step in unpatched["post_init"]), unpatched["post_init"]


def test_contracts_verify_sees_the_composition_fail_without_the_patch_and_hold_with_it(engine_build):
    """verl_npu.contracts.composed (what `verl-npu contracts verify` runs where MindSpeed is installed)."""
    (without,) = engine_build["composed_without_cp_patch"]
    assert not without["ok"] and CP_ASSERTION in without["detail"], without
    (with_patch,) = engine_build["composed"]
    assert with_patch["ok"], with_patch


@pytest.mark.parametrize("engine", ["engine", "second_engine"])
def test_the_example_actor_config_builds_at_cp4_tp2_pp8_ep64(engine_build, engine):
    """With verl-npu's layer, for the actor and for a second engine in the same process (the reference model)."""
    built = engine_build[engine]
    assert "error" not in built, built.get("traceback", built)
    assert built["type"] == "MLATransformerConfig"
    assert built["config"] == {
        "context_parallel_size": 4, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 8,
        "expert_model_parallel_size": 64, "experimental_attention_variant": "dsa",
        "moe_grouped_gemm": False,  # MindSpeed core_r0.18.0 refuses grouped GEMM (contract)
        "use_fused_lightning_indexer": True, "use_dsa_absorb": True,
    }  # fmt: skip
    # MindSpeed's CP wrapper runs exactly once, inside its patch manager's chain
    assert sum(CP_WRAPPER_FILE in step for step in built["post_init"]) == 1, built["post_init"]
    assert set(built["displaced"]) == DISPLACED_ON_THE_FUSED_PATH


def test_every_pipeline_stage_builds_absorbed_mla_with_index_share(engine_build):
    """The bridge's layer specs on each of the 8 stages: 9, 10 x 6, 9 layers; absorbed MLA everywhere; an indexer on
    GLM-5.2's full layers only, the shared ones reusing the latest full layer's top-k."""
    stages = engine_build["stages"]
    assert [len(stage) for stage in stages] == [9, 10, 10, 10, 10, 10, 10, 9]
    kinds = indexer_types(types.SimpleNamespace(**json.loads(EXAMPLE_CONFIG.read_text())))
    layers = [layer for stage in stages for layer in stage]
    assert len(layers) == len(kinds) == 78
    for number, (layer, kind) in enumerate(zip(layers, kinds, strict=True)):
        assert layer["attention"] == "MLASelfAttentionAbsorb", (number, layer)
        assert {"linear_k_up_proj", "linear_v_up_proj"} <= set(layer["attention_submodules"]), (number, layer)
        assert "linear_kv_up_proj" not in layer["attention_submodules"]
        if kind == FULL:
            assert (layer["core_attention"], layer["indexer"]) == ("IndexSourceDSAttention", "DSAIndexer"), number
        else:
            assert layer["core_attention"] == "IndexSharedDSAttention" and layer["indexer"] != "DSAIndexer", number


# --- a tiny GLM-5.2 through MindSpeed's fused DSA forward ------------------------------------------------------------
@pytest.fixture(scope="module")
def fused(mindspeed, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fused")
    inputs = {**TINY, "mindspeed": str(mindspeed["installed"]), "dtypes": ["fp32", "bf16"], "kv_halves_swapped": True}
    return run_scenario("fused_parity", inputs, tmp, "ascend")


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> dict:
    """The same job with verl-npu's portable operators on the CPU, the indexer's inputs rounded to bf16 as the fused
    indexer rounds them (support/ascend_sim_run.py says why)."""
    tmp = tmp_path_factory.mktemp("portable")
    return run_scenario("portable_parity", {**TINY, "dtypes": ["fp32"], "bf16_indexer_inputs": True}, tmp, "cpu")


def _differences(fused_logprobs: list[float], portable_logprobs: list[float]) -> tuple[list[float], list[float]]:
    """|fused - portable| per token, split at the first position whose query selects among more keys than top-k."""
    assert len(fused_logprobs) == len(portable_logprobs)
    d = [abs(a - b) for a, b in zip(fused_logprobs, portable_logprobs, strict=True)]
    # log-prob t is predicted at query t - 1: queries 0..TOPK-1 see at most TOPK keys, so nothing is selected there
    return d[: TOPK - 1], d[TOPK - 1 :]


def agrees_to_fp32_rounding(fused_run: dict, portable_run: dict, part: str = "eval") -> list[str]:
    """Where the fused path and the portable one disagree beyond fp32 rounding (empty: they agree).

    Before top-k binds, every token agrees within 1e-3. Where it binds, the fused indexer's bf16 inputs (rounded on
    both sides) can still flip a near-tied key when fp32-level differences upstream cross a bf16 rounding boundary:
    a token after such a flip may move, so the bound there is on the median (fp32 rounding) and on the share of
    tokens that move by more than 1e-3 (a wrong composition moves most of them)."""
    unselected, selected = _differences(fused_run[part]["logprobs"][0], portable_run[part]["logprobs"][0])
    problems = []
    if max(unselected) > 1e-3:
        problems.append(f"{part}: before top-k binds, max |d log-prob| {max(unselected):.3g} > 1e-3")
    if median(selected) > 1e-4:
        problems.append(f"{part}: where top-k binds, median |d log-prob| {median(selected):.3g} > 1e-4")
    moved = sum(d > 1e-3 for d in selected) / len(selected)
    if moved > 0.05:
        problems.append(f"{part}: where top-k binds, {moved:.0%} of tokens move by > 1e-3 (at most 5% may)")
    return problems


def test_the_fused_path_runs_mindspeeds_operators_in_training_and_evaluation(fused):
    for dtype, run in fused["runs"].items():
        assert run["operators"] == FUSED_OPERATORS, dtype
        assert run["build"]["features"] == ["dsa", "dsa_absorbed_mla", "dsa_fused_operators", "dsa_index_share"]
    assert set(fused["displaced"]) == DISPLACED_ON_THE_FUSED_PATH


def test_in_bf16_the_operators_get_what_they_document_except_mindspeeds_split_views(fused):
    """A launch's dtype: every documented operator rule holds but one, which only a node can settle: MindSpeed hands
    npu_sparse_flash_attention the latent and rope parts of its query and key as split (non-contiguous) views."""
    recorded = fused["runs"]["bf16"]["recorded"]
    assert set(recorded) == {"contiguity"}
    assert {entry.split(" must")[0] for entry in recorded["contiguity"]} == {
        f"npu_sparse_flash_attention: {name}" for name in ("query", "query_rope", "key", "key_rope")
    }


def test_the_fused_path_equals_the_portable_path_to_fp32_rounding(fused, portable):
    """MindSpeed's absorbed MLA, fused indexer, sparse attention and KL-loss operator, IndexShare and the GLM-5 bridge's
    absorbed weights compute what verl-npu's portable path computes: the log-probs, a training step's loss and
    gradient norm (every gradient of the backward), and every DSA layer's selection. (After the step the two drift
    apart: Adam's first update is about lr * sign(gradient), which turns fp32 noise in near-zero gradients into
    updates of +-lr; issue 30's chaos.)"""
    ours, theirs = fused["runs"]["fp32"], portable["runs"]["fp32"]
    assert agrees_to_fp32_rounding(ours, theirs, "eval") == []
    for key in ("losses", "grad_norms"):
        (a,), (b,) = ours["train"][key], theirs["train"][key]
        assert abs(a - b) <= 1e-4 * abs(b), (key, a, b)
    for layer, record in theirs["eval"]["topk"].items():
        expected, got = topk_sets(record), topk_sets(ours["eval"]["topk"][layer])
        assert got.keys() == expected.keys()
        overlap = min(len(got[row] & expected[row]) / len(expected[row]) for row in expected)
        assert overlap == 1.0 if layer.endswith("layers.0") else overlap >= 0.998, (layer, overlap)
    # IndexShare on the fused path: the shared layer 3 attends over the full layer 2's selection
    assert topk_sets(ours["eval"]["topk"]["mb0/layers.3"]) == topk_sets(ours["eval"]["topk"]["mb0/layers.2"])


def test_the_comparison_sees_a_wrong_absorbed_weight_layout(fused, portable):
    """The same comparison fails when the bridge loads kv_b_proj's K rows as V and V rows as K."""
    wrong = {"eval": fused["kv_halves_swapped"]}
    problems = agrees_to_fp32_rounding(wrong, portable["runs"]["fp32"], "eval")
    assert any("move by" in p for p in problems) and any("median" in p for p in problems), problems


def test_the_bf16_run_stays_within_bf16_of_the_fp32_run(fused):
    bf16, fp32 = fused["runs"]["bf16"], fused["runs"]["fp32"]
    d = [abs(a - b) for a, b in zip(bf16["eval"]["logprobs"][0], fp32["eval"]["logprobs"][0], strict=True)]
    assert sum(d) / len(d) < 0.2, sum(d) / len(d)  # bf16's own error here is about 0.09 (measured on this CPU)
