"""The one parallelism record (verl_npu/parallelism.py): its sizes, its rank order and its refusals, against
megatron-core 0.18's own process groups where megatron-core is installed (its RankGenerator needs no
torch.distributed), and as the launch's typed view and the engine's build plan read it."""

from __future__ import annotations

import itertools

import pytest

from verl_npu.parallelism import DP, EP, EP_DENSE, EP_EXPERTS, SP, Parallelism, ParallelismError
from verl_npu.pipeline_split import PP_LAYERS

GLM5_A3 = Parallelism(world=512, tp=2, pp=8, cp=4, ep=64, etp=1, sequence_parallel=True, first_stage_layers=9,
                      last_stage_layers=9)  # fmt: skip


def test_the_data_parallel_sizes_of_the_public_glm5_layout():
    assert (GLM5_A3.dp, GLM5_A3.expert_dp, GLM5_A3.ranks_per_stage) == (512 // 64, 1, 64)
    assert GLM5_A3.stage_layers(78) == [9] + [10] * 6 + [9]
    assert [GLM5_A3.stage_of_rank(r) for r in (0, 63, 64, 511)] == [0, 0, 1, 7]
    assert GLM5_A3.problems(78, 256) == []
    GLM5_A3.validate(78, 256)


def test_every_refusal_is_named_with_its_sizes_and_a_fix():
    bad = Parallelism(world=12, tp=1, pp=2, cp=4, ep=4, etp=1, sequence_parallel=True)
    problems = bad.problems(num_layers=5, num_experts=6)
    assert [p.check for p in problems] == [DP, EP, EP_EXPERTS, SP, PP_LAYERS]
    detail = {p.check: p.message for p in problems}
    assert detail[DP].startswith("world size 12 is not divisible by TP 1 x PP 2 x CP 4 = 8; choose TP, PP and CP")
    assert "PP 2 x EP 4 x ETP 1 = 8 (the expert-parallel group); choose" in detail[EP]
    assert detail[EP_EXPERTS].startswith("EP 4 does not divide the model's 6 routed experts")
    assert "drop sequence_parallel" in detail[SP] and "5 layers over PP 2 do not split evenly" in detail[PP_LAYERS]
    with pytest.raises(ParallelismError) as error:
        bad.validate(num_layers=5, num_experts=6)
    assert error.value.problems == tuple(problems) and isinstance(error.value, ValueError)
    assert str(error.value).count("; ") >= 4  # one message naming every problem
    (dense,) = Parallelism(world=4, ep=2).problems(num_layers=4, num_experts=0)
    assert dense.check == EP_DENSE and "set expert_model_parallel_size=1" in dense.message
    assert Parallelism(world=4, ep=2).problems() == []  # the experts' rules need the model's experts


def test_a_record_without_a_world_has_sizes_and_a_split_but_no_data_parallel_size():
    sizes = Parallelism(world=None, tp=8, pp=2)
    assert sizes.model_parallel == 16 and sizes.stage_layers(4) == [2, 2] and sizes.problems(4, 0) == []
    for read in (lambda: sizes.dp, lambda: sizes.expert_dp, lambda: sizes.stage_of_rank(0)):
        with pytest.raises(ParallelismError, match="need the world size"):
            read()


def test_the_launch_view_holds_the_record_over_its_world():
    from verl_npu.preflight.values import read_launch

    megatron = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
                "override_transformer_config": {"num_layers_in_first_pipeline_stage": 1}}  # fmt: skip
    config = {
        "actor_rollout_ref": {
            "actor": {"strategy": "megatron", "megatron": megatron, "ppo_mini_batch_size": 2},
            "ref": {"megatron": {**megatron, "tensor_model_parallel_size": 4}},
            "rollout": {"n": 1, "gpu_memory_utilization": 0.5},
        },
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 64},
        "trainer": {"nnodes": 2, "n_gpus_per_node": 8},
    }
    values, checks = read_launch(config)
    assert values is not None, checks
    actor, ref = values.actor.parallelism, values.ref.parallelism
    assert actor == Parallelism(world=16, tp=2, pp=2, ep=2, etp=2, first_stage_layers=1)  # null ETP: TP
    assert (actor.dp, actor.expert_dp, ref.dp, ref.etp) == (4, 2, 2, 4)


def test_the_build_plan_reads_the_same_record_from_the_engine_config():
    from verl_npu.engine.build_plan import engine_parallelism, layout_of, pipeline_layout

    engine = {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2, "context_parallel_size": 2,
              "expert_model_parallel_size": 8, "sequence_parallel": True,
              "override_transformer_config": {"num_layers_per_virtual_pipeline_stage": 2}}  # fmt: skip
    sizes = engine_parallelism(engine)
    assert sizes == Parallelism(world=None, tp=4, pp=2, cp=2, ep=8, etp=4, sequence_parallel=True)
    assert pipeline_layout(engine, 8) == layout_of(sizes, 2, 8) and pipeline_layout(engine, 8).vpp == 2


# --- megatron-core's own process groups --------------------------------------------------------------------------
MESHES = [
    # world, tp, pp, cp, ep, etp
    (8, 2, 2, 1, 1, 2),
    (16, 2, 2, 2, 4, 1),
    (32, 4, 2, 1, 8, 2),
    (48, 2, 3, 2, 4, 1),
    (64, 2, 2, 4, 16, 1),
    (512, 2, 8, 4, 64, 1),
]


def megatron_rank_generator():
    """megatron-core's RankGenerator (pure rank arithmetic; its module needs torch)."""
    return pytest.importorskip("megatron.core.parallel_state", reason="megatron-core, the reference").RankGenerator


@pytest.mark.parametrize(("world", "tp", "pp", "cp", "ep", "etp"), MESHES)
def test_the_sizes_and_the_stage_of_each_rank_are_megatrons(world, tp, pp, cp, ep, etp):
    """megatron-core's initialize_model_parallel builds its groups from these two generators, with data-parallel
    size world // (tp * pp * cp) and expert data-parallel size world // (etp * ep * pp), and asserts that both
    give the same pipeline groups; the record's sizes must make both cover the world exactly."""
    RankGenerator = megatron_rank_generator()

    ours = Parallelism(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    assert ours.problems() == []
    order = "tp-cp-ep-dp-pp"  # megatron-core's default
    dense = RankGenerator(tp=tp, ep=1, dp=ours.dp, pp=pp, cp=cp, order=order, rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=ours.expert_dp, pp=pp, cp=1, order=order, rank_offset=0)
    assert dense.world_size == expert.world_size == world
    assert {len(g) for g in dense.get_ranks("dp")} == {ours.dp}
    assert {len(g) for g in expert.get_ranks("dp")} == {ours.expert_dp}
    pipelines = dense.get_ranks("pp")
    assert pipelines == expert.get_ranks("pp")
    stage_of = {rank: stage for group in pipelines for stage, rank in enumerate(group)}
    assert sorted(stage_of) == list(range(world))
    assert all(ours.stage_of_rank(rank) == stage for rank, stage in stage_of.items())


def test_the_record_refuses_the_sizes_megatron_cannot_cover():
    """Where world // (tp * pp * cp) leaves ranks out, megatron's generators do not cover the world: the record
    names the problem instead of handing out a truncated size."""
    RankGenerator = megatron_rank_generator()

    for world, tp, pp, cp, ep, etp in itertools.product((6, 8, 12), (1, 2, 4), (1, 2, 3), (1, 2), (1, 2, 3), (1, 2)):
        ours = Parallelism(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        checks = {p.check for p in ours.problems()}
        dense = RankGenerator(tp=tp, ep=1, dp=max(ours.dp, 1), pp=pp, cp=cp, order="tp-cp-ep-dp-pp", rank_offset=0)
        expert = RankGenerator(tp=etp, ep=ep, dp=max(ours.expert_dp, 1), pp=pp, cp=1, order="tp-cp-ep-dp-pp",
                               rank_offset=0)  # fmt: skip
        assert (DP in checks) == (dense.world_size != world), (world, tp, pp, cp)
        assert (EP in checks) == (expert.world_size != world), (world, pp, ep, etp)
