"""MoE routing replay (R2/R3) through verl 0.9.1's engine API on the tiny GLM-5.2, CPU harness.

The engine runs DSA models padded (``use_remove_padding=False``); verl's record and replay assume packed rows.
These tests watch what every router of the model really chose, on the rows of the padded ``[seq, batch]``
layout, and identify each row's sample by the token ids the model was given, not by any layout function of
the code under test:

* R2 record: the routes verl returns from the log-prob pass are the routes the model used there;
* R2 replay: with the routers perturbed after the record (so their own choice changes for most tokens), under a
  different micro-batch split, every real token of the update uses its recorded experts, and every row, padding
  included, has ``topk`` experts;
* the same with dynamic batching in the log-prob pass and without the mini-batch-wide padding;
* R3: routes handed in as verl's agent loop places the rollout's (one row short: none for the final token,
  which verl's replay mask leaves to the router), through verl's own ``left_right_2_no_padding``.

Param and optimizer offload are on throughout (verl's train/eval contexts offload and onload between passes).
"""

from __future__ import annotations

import pytest
import torch
from support.glm5_2_checkpoint import tiny_glm5_2_checkpoint
from support.router_replay_harness import TOPK, r2_scenario, r3_scenario, replay_engine
from test_glm5_bridge import no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")


@pytest.fixture(scope="module", autouse=True)
def verl_routes_on_the_cpu():
    """verl moves route tensors to its device name ("cuda" off Ascend); the harness's model runs on the CPU, so
    verl's own record/replay code (what runs outside the padded layout) must put them there too."""
    from verl.utils.megatron import router_replay_utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(router_replay_utils, "device_name", "cpu")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_glm5_2_checkpoint(tmp_path_factory.mktemp("glm5_2"))[0]


@pytest.fixture(scope="module")
def r2_engine(model_dir):
    return replay_engine(model_dir, "R2", recompute=True)


@pytest.mark.parametrize(
    "log_prob_split",
    [{"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 64}],
    ids=["micro-batch-2", "dynamic"],
)
def test_r2_records_the_routes_used_and_replays_them_under_another_split(r2_engine, log_prob_split):
    counts = r2_scenario(r2_engine, 11 if log_prob_split["use_dynamic_bsz"] else 12, log_prob_split)
    assert counts["record_wrong"] == 0, f"R2 recorded routes the model did not use: {counts}"
    assert counts["changed_without_replay"] > counts["choices"] // 3, f"the perturbation changes too few: {counts}"
    assert counts["replay_wrong"] == 0, f"recorded routes not replayed: {counts}"
    assert counts["rows_lacking_experts"] == 0, f"rows without {TOPK} experts: {counts}"
    assert counts["router_calls_per_forward"] == 2, f"the backward recomputed no router (replayed there too): {counts}"


@pytest.mark.parametrize("route_layers", [7, 8], ids=["moe-layers", "every-layer"])
def test_r3_replays_the_rollouts_routes_and_leaves_each_final_token_to_the_router(model_dir, route_layers):
    # the mini-batch-wide padding (verl's default) with one, without it with the other
    engine = replay_engine(model_dir, "R3", pad_to_minibatch_max=route_layers == 7)
    counts = r3_scenario(engine, 21, route_layers)
    assert counts["replay_wrong"] == 0 and counts["choices"] > 0, f"rollout routes not replayed: {counts}"
    assert counts["rows_lacking_experts"] == 0, f"rows without {TOPK} experts: {counts}"


def run_ranks(workdir, world: int, *flags: str) -> dict[int, dict]:
    """tests_npu/support/router_replay_parallel.py on ``world`` gloo ranks: each rank's counts, or its error."""
    from support.gloo_ranks import run_ranks as run
    from support.paths import SUPPORT

    return run(SUPPORT / "router_replay_parallel.py", workdir, world, *flags)


@pytest.mark.parametrize("flags", [("--tp", "2"), ("--ep", "2")], ids=["tp2-sp", "ep2"])
def test_r2_and_r3_replay_exactly_under_tensor_sequence_and_expert_parallelism(model_dir, tmp_path, flags):
    """Two gloo ranks: TP=2 with sequence parallelism (each rank's routers see half the positions; the record
    gathers them, the replay splits them) or EP=2 (each rank its own data, experts split)."""
    (tmp_path / "model").symlink_to(model_dir, target_is_directory=True)
    for rank, result in run_ranks(tmp_path, 2, *flags).items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        r2, r3 = result["r2"], result["r3"]
        assert r2["choices"] > 0 and r2["record_wrong"] == 0 and r2["replay_wrong"] == 0, (rank, r2)
        assert r2["changed_without_replay"] > r2["choices"] // 3, (rank, r2)
        assert r3["choices"] > 0 and r3["replay_wrong"] == 0, (rank, r3)
        assert r2["rows_lacking_experts"] == 0 and r3["rows_lacking_experts"] == 0, (rank, r2, r3)


def test_the_padded_layout_conversion_is_exact_under_context_and_sequence_parallelism(tmp_path):
    """CP=2 x TP=2 (SP), four gloo ranks, no model (megatron's DSA refuses CP; MindSpeed brings it on Ascend, and
    the GLM-5.2 example runs CP=4): each rank's router rows are its part of verl's padded forward input (zigzag
    chunks, then contiguous SP blocks), carrying their token ids; the record returns every sample's ids in order,
    the replay lays them back on the rank's rows and marks only real tokens, with and without the mini-batch-wide
    padding."""
    for rank, result in run_ranks(tmp_path, 4, "--layout-only", "--tp", "2", "--cp", "2").items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert len(result) == 2, result
        for lengths, checks in result.items():
            assert checks["record_exact"] and checks["replay_ids_exact"], (rank, lengths, checks)
            assert checks["replayed_rows_are_the_real_tokens"], (rank, lengths, checks)


def test_routes_that_do_not_fit_the_padded_forward_are_refused_naming_both_shapes():
    from types import SimpleNamespace

    from verl_npu.engine.router_replay import PaddedLayout, replay_targets, rows_to_samples

    layout = PaddedLayout(lengths=(3, 5), forced_max_seqlen=None, use_fp8_padding=False)
    tf_config = SimpleNamespace(sequence_parallel=False, fp8=None)
    short = torch.nested.nested_tensor_from_jagged(
        torch.zeros(7, 2, 2, dtype=torch.int16), offsets=torch.tensor([0, 3, 7])
    )
    with pytest.raises(RuntimeError, match=r"expected per-sample lengths \[3, 5\] \(input_ids\), found \[3, 4\]"):
        replay_targets(short, None, layout, tf_config, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"expected 5 positions x 2 samples = 10 rows, found 9"):
        rows_to_samples(torch.zeros(9, 2, 4, dtype=torch.uint8), layout, tf_config)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-blocks"])
@pytest.mark.parametrize("forced", [None, 61], ids=["own-longest", "forced"])
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
def test_the_layout_is_verls_preprocess_bshd_engine(tp, cp, forced, fp8, monkeypatch):
    """PaddedLayout computes verl's padding (verl's own function builds a [b, 1, s, s] mask on Ascend each call):
    against verl's preprocess_bshd_engine on every CP rank, with megatron's TP/CP sizes and rank set as a
    TP x CP group would have them."""
    from megatron.core import parallel_state
    from verl.models.mcore.util import preprocess_bshd_engine

    from verl_npu.engine.router_replay import PaddedLayout

    lengths = (13, 29, 6, 21, 1)
    ids = torch.nested.nested_tensor_from_jagged(
        torch.arange(1, sum(lengths) + 1), offsets=torch.tensor([0, *lengths]).cumsum(0)
    )
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
        expected, mask, _ = preprocess_bshd_engine(ids, use_fp8_padding=fp8, forced_max_seqlen=forced)
        layout = PaddedLayout(lengths, forced, fp8, tp_size=tp, cp_size=cp, cp_rank=rank)
        assert torch.equal(layout.pad(ids), expected), (rank, layout.padded_length())
        assert torch.equal(layout.valid(), mask.bool()), rank
