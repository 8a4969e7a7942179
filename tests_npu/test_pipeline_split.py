"""The one pipeline split (verl_npu/pipeline_split.py) against megatron-core 0.18's own: its TransformerConfig and
get_num_layers_to_build, on every case of a property test, and the readers that use it agree."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_npu.pipeline_split import PP_LAYERS, VPP_LAYERS, PipelineSplitError, stage_layers

torch = pytest.importorskip("torch", reason="megatron-core, the reference, needs torch")


def megatron_stage_layers(num_layers: int, pp: int, first: int | None, last: int | None, vpp: int | None):
    """Each stage's layers as megatron-core builds them, or the exception its config or its split raises."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.bfloat16,
        )  # fmt: skip
        chunks = [None] if vpp is None or pp == 1 else range(vpp)
        stages = [sum(get_num_layers_to_build(config, vp_stage=v, pp_rank=r) for v in chunks) for r in range(pp)]
    except (ValueError, AssertionError) as exc:
        return exc
    if min(stages) < 0:  # its config lets end stages above the model's layers through; building would fail
        return ValueError(f"megatron splits {num_layers} layers into {stages}")
    return stages


layouts = st.tuples(
    st.integers(1, 48),  # layers
    st.integers(2, 8),  # PP
    st.none() | st.integers(0, 12),  # first stage
    st.none() | st.integers(0, 12),  # last stage
    st.none() | st.integers(1, 4),  # VPP
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts)
def test_the_split_is_megatrons_on_every_layout(layout):
    num_layers, pp, first, last, vpp = layout
    theirs = megatron_stage_layers(num_layers, pp, first, last, vpp)
    try:
        ours = stage_layers(num_layers, pp, first, last, vpp)
    except PipelineSplitError as exc:
        assert isinstance(theirs, Exception), f"{layout}: we refuse ({exc}), megatron builds {theirs}"
        return
    assert not isinstance(theirs, Exception), f"{layout}: megatron refuses ({theirs}), we split {ours}"
    assert ours == theirs, layout


def test_the_issues_edge_case_is_refused_where_megatron_refuses_it():
    # 4 layers, PP 3, 2 on the first and 2 on the last stage: the middle stage would hold none
    with pytest.raises(PipelineSplitError, match=r"= 0 over 1 stages do not split evenly") as error:
        stage_layers(4, 3, first=2, last=2)
    assert error.value.check == PP_LAYERS
    assert isinstance(megatron_stage_layers(4, 3, 2, 2, None), ValueError)
    with pytest.raises(PipelineSplitError, match="set but PP is 1"):
        stage_layers(4, 1, first=4)
    with pytest.raises(PipelineSplitError, match=r"3 layers per stage do not divide into VPP 2") as error:
        stage_layers(12, 4, vpp=2)
    assert error.value.check == VPP_LAYERS
    assert stage_layers(78, 8, first=9, last=9) == [9] + [10] * 6 + [9]


def test_every_reader_of_the_split_gives_the_same_answer():
    from verl_npu.engine.build_plan import model_chunks, pipeline_layout
    from verl_npu.parallelism import Parallelism
    from verl_npu.preflight.mesh import check_train_mesh

    def readers(num_layers: int, pp: int, first: int | None, last: int | None):
        """The one record's split (the mesh check's, the memory model's) and the build plan's model chunks."""
        record = Parallelism(world=pp, pp=pp, first_stage_layers=first, last_stage_layers=last)
        otc = {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last}
        engine = {"pipeline_model_parallel_size": pp, "override_transformer_config": otc}
        return (
            lambda: record.stage_layers(num_layers),
            lambda: [c.num_layers for c in model_chunks(num_layers, pipeline_layout(engine, num_layers))],
        )

    assert [read() for read in readers(78, 8, 9, 9)] == [[9] + [10] * 6 + [9]] * 2
    for read in readers(4, 3, 2, 2):  # the edge case three of four copies once split as [2, 0, 2]
        with pytest.raises(PipelineSplitError, match="do not split evenly"):
            read()
    record = Parallelism(world=3, pp=3, first_stage_layers=2, last_stage_layers=2)
    (check,) = check_train_mesh("actor", record, 4, 0)
    assert check.check == "mesh.actor-pp-layers" and check.status == "fail" and "do not split evenly" in check.detail
