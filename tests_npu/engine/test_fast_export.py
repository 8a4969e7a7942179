"""verl_npu.engine.bridges.fast_export: mbridge 0.15.1's export to the rollout, its pipeline metadata exchanged once.

The fast export must yield what mbridge's ``Bridge.export_weights`` yields (names in order, classes, dtypes, bytes)
for a tiny dense Qwen2 (mbridge's Qwen2 bridge) and a tiny GLM-5 (verl-npu's bridge, with MoE experts and the
router's expert bias), in one process and on two gloo ranks under pipeline (with virtual stages), tensor and expert
parallelism; and it must spare the collectives: none without pipeline parallelism, where mbridge makes three
object collectives per tensor, and one ``all_gather_object`` per export with it. Models and the rank script:
tests_npu/support/fast_export_parallel.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.fast_export_parallel import (
    LAYOUTS,
    build,
    count_calls,
    differences,
    mbridge_export,
    megatron_tensor_count,
)

pytest.importorskip("mbridge", reason="the fast export replaces mbridge's; not installed here")

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # the router's expert bias, a buffer in megatron


@pytest.fixture(scope="module")
def dense():
    return build("dense")


@pytest.fixture(scope="module")
def glm5():
    return build("glm5")


def fast(bridge, models) -> list[tuple[str, torch.Tensor]]:
    from verl_npu.engine.bridges import fast_export

    return list(fast_export.export_weights(bridge, models))


def test_the_comparison_sees_one_bit_a_dtype_and_the_order():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    flipped = a.view(torch.int32).clone()
    flipped[1] ^= 1
    assert differences([("a", a), ("b", b)], [("a", a.clone()), ("b", b.clone())]) == []
    assert differences([("a", a)], [("a", flipped.view(torch.float32))]) == ["a: other values"]
    assert differences([("a", a)], [("a", a.double())])[0].startswith("a: Tensor cpu torch.Size([2]) torch.float32")
    assert differences([("a", a), ("b", b)], [("b", b), ("a", a)])[0].startswith("names:")
    assert differences([("a", torch.nn.Parameter(a))], [("a", a)])  # mbridge yields a stage's own parameters


def test_a_dense_models_export_is_mbridges(dense):
    bridge, models = dense
    ours = fast(bridge, models)
    assert len(ours) > megatron_tensor_count(models)  # mbridge's Qwen2 splits each fused QKV into q, k and v
    assert differences(ours, mbridge_export(bridge, models)) == []


def test_glm5_bridges_export_is_mbridges_under_the_same_absorbed_mla_bookkeeping(glm5, monkeypatch):
    """GLM5Bridge.export_weights wraps the generator (it holds absorbed K/V halves until both came); the reference
    runs the same wrapper over mbridge's generator."""
    from mbridge.core.bridge import Bridge
    from mbridge.core.util import unwrap_model

    from verl_npu.engine.bridges import fast_export

    bridge, models = glm5
    ours = list(bridge.export_weights(models))
    monkeypatch.setattr(fast_export, "export_weights", Bridge.export_weights)
    theirs = list(bridge.export_weights(models))
    assert differences(ours, theirs) == []
    names = [name for name, _ in ours]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and names[-1] == BIAS
    router = unwrap_model(models[0]).decoder.layers[1].mlp.router  # the live buffer, not a copy made before
    assert torch.equal(dict(ours)[BIAS], router.expert_bias) and router.expert_bias.abs().sum() > 0


@pytest.mark.parametrize("model", ["dense", "glm5"])
def test_without_pipeline_parallelism_there_is_no_object_collective(model, dense, glm5, monkeypatch):
    """mbridge gathers each tensor's name and spec and broadcasts its name even for one stage: 2 all_gather_object
    and one broadcast_object_list per tensor, plus the names' all_gather_object; the fast export makes none."""
    bridge, models = dense if model == "dense" else glm5
    tensors = megatron_tensor_count(models)
    with monkeypatch.context() as patch:
        theirs = count_calls(patch.setattr)
        mbridge_export(bridge, models)
    assert theirs == {"all_gather_object": 2 * tensors + 1, "broadcast_object_list": tensors, "broadcast": tensors}
    with monkeypatch.context() as patch:
        ours = count_calls(patch.setattr)
        exported = list(bridge.export_weights(models)) if model == "glm5" else fast(bridge, models)
    assert exported and sum(ours.values()) == 0, ours


# --- two gloo ranks ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    """Each rank's results per layout (tests_npu/support/fast_export_parallel.py)."""
    from support.gloo_ranks import run_ranks
    from support.paths import REPO, SUPPORT, TESTS

    search_path = [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(search_path))  # the ranks import verl_npu and support
        ranks = run_ranks(SUPPORT / "fast_export_parallel.py", tmp_path_factory.mktemp("fast-export"), 2)
    for rank, result in ranks.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return ranks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_exports_what_mbridge_does(two_ranks, layout):
    """Under PP every rank yields every stage's tensors; under TP and EP the gathered ones."""
    sizes = LAYOUTS[layout][1]
    for rank, results in two_ranks.items():
        result = results[layout]
        assert result["names"], (rank, layout)
        assert result["differences"] == [], (rank, layout)
        assert result["chunks"] == sizes.get("vpp", 1)
    assert two_ranks[0][layout]["names"] == two_ranks[1][layout]["names"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_loads_the_export_back_through_the_fast_load(two_ranks, layout):
    """The export written as an HF checkpoint (two files, an index) and loaded into the zeroed model: every value
    back, under PP (each stage its layers), TP (rank 0 reads and scatters), EP (each rank its experts), and with
    tied embeddings (the dense model: one tensor taken for two parameters)."""
    for rank, results in two_ranks.items():
        assert results[layout]["load_differences"] == [], (rank, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_metadata_exchange_per_export_and_one_broadcast_per_tensor_under_pp(two_ranks, layout):
    for results in two_ranks.values():
        result = results[layout]
        if LAYOUTS[layout][1].get("pp", 1) > 1:
            assert result["counts"] == {"all_gather_object": 1, "broadcast": result["pipeline_tensors"]}
        else:
            assert result["counts"] == {}
