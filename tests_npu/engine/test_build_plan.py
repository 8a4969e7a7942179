"""The engine's build plan, rule by rule, on verl's own config dataclasses and transformers' GLM-5 config."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="reads verl's engine config dataclasses; verl is not installed here")

from transformers import GlmMoeDsaConfig, LlamaConfig
from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

from verl_npu.engine.build_plan import BuildPlanError, build_plan
from verl_npu.models.glm5.config import glm5_2_indexer_types


def engine(**overrides) -> McoreEngineConfig:
    return McoreEngineConfig(**{"use_remove_padding": False, "vanilla_mbridge": True, **overrides})


def optim(**overrides) -> McoreOptimizerConfig:
    return McoreOptimizerConfig(lr=1e-6, **overrides)


GLM5 = GlmMoeDsaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, index_n_heads=32)
LLAMA = LlamaConfig(num_hidden_layers=2, hidden_size=64)


class LayerNormModel:
    """A model config with LayerNorm (no rms_norm_eps), like GPT-2 / OPT."""

    layer_norm_eps = 1e-5


def test_megatron_bridge_path_is_refused_with_the_mbridge_alternative():
    with pytest.raises(BuildPlanError, match=r"megatron\.vanilla_mbridge=False.*Megatron-Bridge.*vanilla_mbridge=True"):
        build_plan(engine(vanilla_mbridge=False), optim(), LLAMA, "cuda")


def test_plain_dense_model_has_nothing_to_do():
    plan = build_plan(engine(), optim(), LLAMA, "cuda")
    assert plan.features == () and plan.mindspeed_repatch is None and plan.rmsnorm_impl is None


def test_fused_rmsnorm_swaps_the_norm_off_ascend():
    plan = build_plan(engine(override_transformer_config={"use_fused_rmsnorm": True}), optim(), LLAMA, "cuda")
    assert "fused_rmsnorm" in plan.features and plan.rmsnorm_impl == "verl_npu.engine.modules.RMSNorm"
    assert plan.transformer_overrides["normalization"] == "RMSNorm"
    assert "use_fused_rmsnorm" not in plan.transformer_overrides  # not a megatron-core field


def test_on_ascend_the_norm_is_te_npus_whatever_use_fused_rmsnorm_says_and_the_plan_says_so():
    # contract mindspeed-norm-ignores-use-fused-rmsnorm: MindSpeed's PTNorm builds TE-NPU's RMSNorm
    otc = {"use_fused_rmsnorm": True, "use_fused_swiglu": True}
    plan = build_plan(engine(override_transformer_config=otc), optim(), LLAMA, "ascend")
    assert "fused_rmsnorm" not in plan.features
    assert plan.rmsnorm_impl == "TransformerEngine-NPU RMSNorm (MindSpeed's PTNorm)"
    assert build_plan(engine(), optim(), LLAMA, "ascend").rmsnorm_impl == plan.rmsnorm_impl
    assert any("use_fused_rmsnorm changes nothing on Ascend" in w for w in plan.warnings)
    assert any("use_fused_swiglu has no effect" in w for w in plan.warnings)
    assert plan.mindspeed_repatch["use_fused_rmsnorm"] is True  # passed on, as upstream verl does


def test_fused_rmsnorm_requires_rmsnorm():
    with pytest.raises(
        BuildPlanError,
        match=r"use_fused_rmsnorm=True: fused RMSNorm requires normalization='RMSNorm'.*'LayerNorm'.*Instead: remove",
    ):
        build_plan(engine(override_transformer_config={"use_fused_rmsnorm": True}), optim(), LayerNormModel(), "cuda")


def test_glm5_is_dsa_with_its_indexer_shape():
    plan = build_plan(engine(), optim(), GLM5, "cuda")
    tf = plan.transformer_overrides
    assert "dsa" in plan.features
    assert tf["experimental_attention_variant"] == "dsa" and tf["qk_layernorm"] is True
    assert tf["apply_rope_fusion"] is False and tf["multi_latent_attention"] is True
    assert (tf["dsa_indexer_n_heads"], tf["dsa_indexer_head_dim"], tf["dsa_indexer_topk"]) == (32, 128, 2048)


def test_dsa_requires_mla():
    with pytest.raises(BuildPlanError, match="requires multi-latent attention"):
        build_plan(
            engine(override_transformer_config={"experimental_attention_variant": "dsa"}), optim(), LLAMA, "cuda"
        )


def test_dsa_requires_qk_layernorm_and_no_rope_fusion():
    with pytest.raises(BuildPlanError, match="qk_layernorm=False: DSA requires qk_layernorm"):
        build_plan(engine(override_transformer_config={"qk_layernorm": False}), optim(), GLM5, "cuda")
    with pytest.raises(BuildPlanError, match="apply_rope_fusion=True"):
        build_plan(engine(override_transformer_config={"apply_rope_fusion": True}), optim(), GLM5, "cuda")


def test_dsa_rejects_packed_thd_input():
    with pytest.raises(BuildPlanError, match=r"use_remove_padding=True: DSA does not support packed \(THD\) input"):
        build_plan(engine(use_remove_padding=True), optim(), GLM5, "cuda")


DSA_SWITCHES = dict.fromkeys(
    (
        "use_dsa_absorb",
        "use_fused_lightning_indexer",
        "use_fused_sparse_flash_attention",
        "use_fused_lightning_indexer_kl_loss",
    ),
    True,
)
GLM5_REAL = GlmMoeDsaConfig()  # transformers' defaults are GLM-5's published shape (64 heads, latent 512 + 64)


def test_the_three_fused_operators_need_absorption_and_all_four_switches_go_together():
    three = {k: v for k, v in DSA_SWITCHES.items() if k != "use_dsa_absorb"}
    with pytest.raises(
        BuildPlanError, match=r"go on or off together.*also set override_transformer_config\.use_dsa_absorb"
    ):
        build_plan(engine(override_transformer_config=three), optim(), GLM5_REAL, "ascend")
    two = {"use_fused_lightning_indexer": True, "use_fused_sparse_flash_attention": True}
    with pytest.raises(BuildPlanError, match=r"also set .*use_dsa_absorb=True, .*use_fused_lightning_indexer_kl_loss"):
        build_plan(engine(override_transformer_config=two), optim(), GLM5_REAL, "ascend")
    with pytest.raises(BuildPlanError, match="go on or off together"):
        build_plan(engine(override_transformer_config={"use_dsa_absorb": True}), optim(), GLM5_REAL, "ascend")
    plan = build_plan(engine(override_transformer_config=DSA_SWITCHES), optim(), GLM5_REAL, "ascend")
    assert {"dsa_absorbed_mla", "dsa_fused_operators"} <= set(plan.features)
    assert all(plan.mindspeed_repatch[k] is True for k in DSA_SWITCHES)
    assert any("linear_k_up_proj + linear_v_up_proj" in n for n in plan.notes)
    assert any("also at dsa_indexer_loss_coeff=0" in n for n in plan.notes)
    cuda = build_plan(engine(override_transformer_config=DSA_SWITCHES), optim(), GLM5_REAL, "cuda")
    assert "dsa_fused_operators" not in cuda.features and any("portable/Triton" in w for w in cuda.warnings)


def test_fused_operator_shape_rules_are_all_reported_in_one_error():
    # the small nightly model's old shape: every rule of the fused operators broken at once
    odd = GlmMoeDsaConfig(
        num_hidden_layers=2, hidden_size=256, num_attention_heads=8, index_n_heads=128, index_head_dim=64,
        index_topk=512, kv_lora_rank=128, qk_rope_head_dim=32,
    )  # fmt: skip
    with pytest.raises(BuildPlanError) as error:
        build_plan(engine(override_transformer_config=DSA_SWITCHES), optim(), odd, "ascend")
    problems = error.value.problems
    for expected in (
        "kv_lora_rank=128, qk_rope_head_dim=32: npu_sparse_flash_attention takes one latent key head of 512",
        "num_attention_heads=8: the fused KL-loss operator takes the TP-gathered attention heads in (32, 64, 128)",
        "dsa_indexer_n_heads=128: the fused indexer and KL-loss operators take (8, 16, 32, 64)",
        "dsa_indexer_head_dim=64: npu_lightning_indexer takes indexer head dim 128",
        "dsa_indexer_topk=512: the fused KL-loss operator takes a top-k that is a multiple of 1024",
    ):
        assert any(expected in p for p in problems), (expected, problems)
    assert all("Instead: drop the four DSA switches" in p for p in problems)


def test_attention_heads_per_device_must_be_a_power_of_two():
    with pytest.raises(BuildPlanError, match=r"tensor_model_parallel_size=3.*per device"):
        build_plan(
            engine(tensor_model_parallel_size=3, override_transformer_config=DSA_SWITCHES), optim(), GLM5_REAL, "ascend"
        )


def test_mindspeed_repatch_gets_the_whole_override_config_and_what_its_dsa_path_reads():
    """MindSpeed's DSA feature applies only when experimental_attention_variant == 'dsa' reaches repatch (it
    registers no option for it), and its fused forward reads context_parallel_size without a default."""
    from verl_npu.contracts.mindspeed import ARGS_READ_WITHOUT_DEFAULT

    otc = {**DSA_SWITCHES, "recompute_granularity": "full", "context_parallel_algo": "kvallgather_cp_algo"}
    plan = build_plan(engine(override_transformer_config=otc), optim(), GLM5_REAL, "ascend")
    repatch = plan.mindspeed_repatch
    assert repatch["experimental_attention_variant"] == "dsa" and repatch["multi_latent_attention"] is True
    assert repatch["recompute_granularity"] == "full"
    assert (repatch["dsa_indexer_n_heads"], repatch["dsa_indexer_topk"]) == (32, 2048)
    assert all(key in repatch for key in ARGS_READ_WITHOUT_DEFAULT), repatch
    assert repatch["context_parallel_size"] == 1
    assert set(plan.transformer_overrides) <= set(repatch)


def test_every_violated_rule_is_reported_in_one_run():
    otc = {"qk_layernorm": False, "apply_rope_fusion": True, "use_fused_lightning_indexer": True}
    with pytest.raises(BuildPlanError) as error:
        build_plan(
            engine(vanilla_mbridge=False, use_remove_padding=True, override_transformer_config=otc),
            optim(exp_avg_dtype="bf16"),
            GLM5,
            "ascend",
        )
    text = str(error.value)
    for rule in ("Megatron-Bridge", "qk_layernorm", "apply_rope_fusion", "packed (THD)", "go on or off together",
                 "precision-aware optimizer"):  # fmt: skip
        assert rule in text, rule
    assert len(error.value.problems) == 6


def test_dsa_switches_without_dsa_are_an_error():
    with pytest.raises(BuildPlanError, match="DSA switches need a DSA model"):
        build_plan(engine(override_transformer_config={"use_fused_lightning_indexer": True}), optim(), LLAMA, "ascend")


def test_dsa_context_parallel_needs_kv_allgather_on_ascend_and_is_refused_elsewhere():
    with pytest.raises(
        BuildPlanError,
        match=r"context_parallel_algo=None.*set override_transformer_config.context_parallel_algo=kvallgather_cp_algo",
    ):
        build_plan(engine(context_parallel_size=4), optim(), GLM5, "ascend")
    plan = build_plan(
        engine(context_parallel_size=4, override_transformer_config={"context_parallel_algo": "kvallgather_cp_algo"}),
        optim(), GLM5, "ascend",
    )  # fmt: skip
    assert plan.mindspeed_repatch["context_parallel_size"] == 4
    assert plan.mindspeed_repatch["context_parallel_algo"] == "kvallgather_cp_algo"
    assert plan.mindspeed_repatch["experimental_attention_variant"] == "dsa"  # the CP bypass needs both
    assert "dsa_cp_kvallgather" in plan.features and any("kv-allgather" in n for n in plan.notes)
    with pytest.raises(BuildPlanError, match="asserts context_parallel_size=1"):
        build_plan(engine(context_parallel_size=2), optim(), GLM5, "cuda")


def test_offload_features():
    plan = build_plan(engine(param_offload=True, optimizer_offload=True), optim(), LLAMA, "cpu")
    assert {"param_offload", "optimizer_offload"} <= set(plan.features)


def test_precision_aware_optimizer_aligns_ddp_buckets_unless_user_set_them():
    pa = optim(
        use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"
    )
    plan = build_plan(engine(), pa, LLAMA, "ascend")
    assert "precision_aware_optimizer" in plan.features and plan.ddp_overrides == {"grad_reduce_in_fp32": False}
    user = build_plan(engine(override_ddp_config={"grad_reduce_in_fp32": True}), pa, LLAMA, "ascend")
    assert user.ddp_overrides == {}


def test_precision_aware_optimizer_rules():
    pa = optim(use_precision_aware_optimizer=True)
    with pytest.raises(BuildPlanError, match=r"requires the distributed optimizer.*use_distributed_optimizer=True"):
        build_plan(engine(use_distributed_optimizer=False), pa, LLAMA, "ascend")
    with pytest.raises(BuildPlanError, match="needs TransformerEngine's FusedAdam"):
        build_plan(engine(), pa, LLAMA, "cpu")
    with pytest.raises(BuildPlanError, match=r"optim\.exp_avg_dtype=bf16.*only take effect with the precision-aware"):
        build_plan(engine(), optim(exp_avg_dtype="bf16"), LLAMA, "ascend")
    raw = {"use_precision_aware_optimizer": True, "main_grads_dtype": "fp16"}  # a raw dict, as preflight passes
    with pytest.raises(
        BuildPlanError, match=r"optim\.main_grads_dtype=fp16: main_grads_dtype must be one of fp32, bf16"
    ):
        build_plan(engine(), raw, LLAMA, "ascend")
    aliases = optim(use_precision_aware_optimizer=True, main_grads_dtype="bfloat16", exp_avg_dtype="float32")
    assert build_plan(engine(), aliases, LLAMA, "ascend").ddp_overrides == {"grad_reduce_in_fp32": False}


# --- GLM-5.2's IndexShare layers: what the pipeline top-k carry can serve ---------------------------------
# GLM-5.2's rule (i < 3 or (i - 2) % 4 == 0) on 8 layers: full 0, 1, 2, 6; shared 3, 4, 5, 7
GLM52_KINDS = glm5_2_indexer_types(8)
GLM52 = GlmMoeDsaConfig(
    num_hidden_layers=8, hidden_size=256, num_attention_heads=8, index_n_heads=32, indexer_types=GLM52_KINDS
)


def test_megatron_places_model_chunks_where_the_build_plan_says():
    """model_chunks against megatron-core 0.18's own get_transformer_layer_offset, VPP and uneven ends included."""
    import types

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from verl_npu.engine.build_plan import PipelineLayout, model_chunks

    for layers, pp, vpp, first, last in [
        (78, 8, None, 9, 9), (78, 8, 2, 10, 8), (8, 2, 2, None, None), (14, 3, 2, None, 2), (14, 3, 2, 2, None),
        (16, 4, 4, None, None), (8, 1, None, None, None),
    ]:  # fmt: skip
        config = types.SimpleNamespace(
            num_layers=layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
        )  # fmt: skip
        chunks = model_chunks(layers, PipelineLayout(pp, vpp, first, last))
        assert sum(c.num_layers for c in chunks) == layers
        for chunk in chunks:
            if pp > 1:
                assert get_transformer_layer_offset(config, chunk.vp_stage, chunk.pp_rank) == chunk.first_layer, chunk


def test_glm5_2_pipeline_stages_that_start_shared_receive_the_carry():
    otc = {"num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2}
    plan = build_plan(engine(pipeline_model_parallel_size=3, override_transformer_config=otc), optim(), GLM52, "cuda")
    assert "dsa_index_share" in plan.features
    (note,) = [n for n in plan.notes if n.startswith("IndexShare")]
    # stages start at layers 0, 3 (shared), 6 (full)
    assert "4 full / 4 shared DSA indexers" in note and "stages 1 start on a shared layer" in note
    assert "dsa_index_share" not in build_plan(engine(), optim(), GLM5, "cuda").features  # GLM-5: every layer full


def test_an_interleaved_pipeline_whose_chunks_start_shared_is_refused_naming_the_same_pp_without_vpp():
    with pytest.raises(BuildPlanError) as error:
        build_plan(
            engine(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), optim(), GLM52, "cuda"
        )
    (problem,) = error.value.problems
    # chunks of 2 layers start at 0, 2, 4, 6 (stage 0, stage 1, stage 0, stage 1): layer 4 is shared
    assert problem.startswith("virtual_pipeline_model_parallel_size=2 (PP 2 x VPP 2) on a model with 4 shared DSA")
    assert "stage 0 chunk 1 (layers 4-5) starts on shared layer 4" in problem
    assert "stage 1 chunk" not in problem  # layers 2 and 6 are full: those chunks need no carry
    assert "Instead: the same PP 2 without a virtual pipeline" in problem
    assert "its stages start at layers 0, 4, and stage 1 receives the top-k from the stage before" in problem
    # Megatron-LM's way of asking for it: 4 layers a stage in chunks of 2 is VPP 2
    otc = {"num_layers_per_virtual_pipeline_stage": 2}
    with pytest.raises(BuildPlanError, match=r"num_layers_per_virtual_pipeline_stage=2 \(PP 2 x VPP 2\)"):
        build_plan(engine(pipeline_model_parallel_size=2, override_transformer_config=otc), optim(), GLM52, "cuda")
    # every chunk starting on a full layer needs no carry: allowed
    alternating = GlmMoeDsaConfig(
        num_hidden_layers=8, hidden_size=256, num_attention_heads=8, index_n_heads=32,
        indexer_types=["full", "shared"] * 4,
    )  # fmt: skip
    plan = build_plan(
        engine(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), optim(), alternating, "cuda"
    )
    assert "dsa_index_share" in plan.features
    assert build_plan(engine(pipeline_model_parallel_size=2), optim(), GLM52, "cuda")  # the same PP without VPP


def test_a_model_whose_first_layer_is_shared_is_refused():
    first_shared = {**GLM52.to_dict(), "indexer_types": ["shared", *GLM52_KINDS[1:]]}  # a raw dict, as preflight passes
    with pytest.raises(BuildPlanError) as error:
        build_plan(engine(), optim(), first_shared, "cuda")
    (problem,) = error.value.problems
    assert problem.startswith("indexer_types (model config): indexer_types[0] is 'shared', but the first layer has no")
    assert "Instead: a model config whose indexer_types lists 'full' or 'shared' for every layer and marks layer 0" in (
        problem
    )


@pytest.mark.parametrize("modules", [None, ["core_attn"], ["core_attn", "mlp"]])
def test_dsa_refuses_selective_recompute_of_core_attention(modules):
    otc = {"recompute_granularity": "selective", **({"recompute_modules": modules} if modules is not None else {})}
    for model in (GLM5, GLM52):  # any DSA model, IndexShare or not
        with pytest.raises(BuildPlanError) as error:
            build_plan(engine(override_transformer_config=otc), optim(), model, "ascend")
        (problem,) = error.value.problems
        shown = (
            "recompute_modules unset (megatron's default ['core_attn'])"
            if modules is None
            else f"recompute_modules={modules}"
        )
        assert problem.startswith(f"override_transformer_config.recompute_granularity=selective with {shown}")
        assert "without passing DSA its x and qr inputs" in problem
        assert "Instead: set override_transformer_config.recompute_granularity=full" in problem
        assert 'recompute_modules that leave out core_attn, e.g. ["mla_up_proj", "mlp"]' in problem


def test_dsa_takes_full_recompute_and_selective_recompute_without_core_attention():
    for otc in (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj", "mlp"]},
    ):
        assert "dsa" in build_plan(engine(override_transformer_config=otc), optim(), GLM52, "ascend").features
    selective = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    assert build_plan(engine(override_transformer_config=selective), optim(), LLAMA, "cuda")  # no DSA: fine


def test_every_indexshare_and_recompute_rule_is_reported_in_one_run():
    otc = {"recompute_granularity": "selective"}
    with pytest.raises(BuildPlanError) as error:
        build_plan(
            engine(
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, use_remove_padding=True,
                override_transformer_config=otc,
            ),
            optim(), GLM52, "cuda",
        )  # fmt: skip
    problems = error.value.problems
    assert len(problems) == 3, problems
    for rule in ("packed (THD)", "selective recompute of core_attn", "starts on shared layer 4"):
        assert any(rule in p for p in problems), rule


@pytest.mark.parametrize("dtype", ["fp8", "fp16", "float16"])
def test_the_build_plan_refuses_optimizer_states_verl_refuses(dtype):
    """verl 0.9.1's McoreOptimizerConfig takes fp32 or bf16 moments only: preflight must not say go on fp8."""
    from verl.workers.config.optimizer import McoreOptimizerConfig

    with pytest.raises(AssertionError, match="exp_avg_dtype"):
        McoreOptimizerConfig(lr=1e-6, exp_avg_dtype=dtype)
    with pytest.raises(BuildPlanError, match=r"optim\.exp_avg_dtype=fp(8|16): .*McoreOptimizerConfig refuses"):
        raw = {"use_precision_aware_optimizer": True, "exp_avg_dtype": dtype}  # a raw dict, as preflight passes
        build_plan(engine(), raw, LLAMA, "ascend")


def test_grouped_experts_are_refused_on_ascend_where_mindspeed_refuses_them():
    """MindSpeed core_r0.18.0 raises NotImplementedError for moe_grouped_gemm when the config is built (contract
    mindspeed-refuses-moe-grouped-gemm): the plan says so before the job queues; elsewhere it is megatron's switch."""
    grouped = engine(override_transformer_config={"moe_grouped_gemm": True})
    with pytest.raises(BuildPlanError, match=r"moe_grouped_gemm=True: MindSpeed core_r0\.18\.0 refuses grouped GEMM"):
        build_plan(grouped, optim(), GLM5, "ascend")
    assert build_plan(grouped, optim(), GLM5, "cuda").transformer_overrides["moe_grouped_gemm"] is True
    assert "moe_grouped_gemm" not in build_plan(engine(), optim(), GLM5, "ascend").transformer_overrides


def test_the_glm5_bridge_groups_experts_off_ascend_only():
    from verl_npu.models.glm5.config import glm5_config_fields

    assert glm5_config_fields(GLM5, "ascend")["moe_grouped_gemm"] is False
    assert glm5_config_fields(GLM5, "cuda")["moe_grouped_gemm"] is True


# --- MoE routing replay (R2/R3) ------------------------------------------------------------------------------


def replay(mode: str, **overrides) -> McoreEngineConfig:
    from verl.workers.config.engine import EngineRouterReplayConfig

    return engine(router_replay=EngineRouterReplayConfig(mode=mode), **overrides)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_on_the_padded_layout_is_laid_out_by_the_engine(mode):
    plan = build_plan(replay(mode), optim(), GLM5, "ascend")
    assert "router_replay_padded" in plan.features
    assert any(f"router replay {mode} on the padded layout" in note for note in plan.notes)
    assert "router_replay_padded" not in build_plan(engine(), optim(), GLM5, "ascend").features


def test_replay_that_cannot_keep_the_recorded_experts_is_refused_with_every_reason_at_once():
    otc = {"moe_expert_capacity_factor": 1.0, "moe_tp_extend_ep": True}
    with pytest.raises(BuildPlanError) as refused:
        build_plan(replay("R3", override_transformer_config=otc), optim(), GLM5, "ascend")
    text = str(refused.value)
    assert "router_replay.mode=R3 with override_transformer_config.moe_expert_capacity_factor=1.0" in text
    assert "override_transformer_config.moe_tp_extend_ep=True: " in text and "TopKRouter.routing" in text
    assert "dropless" in text
    # off Ascend MindSpeed's tp-extend-ep does not exist; the capacity rule holds everywhere
    with pytest.raises(BuildPlanError) as refused:
        build_plan(replay("R2", override_transformer_config=otc), optim(), GLM5, "cuda")
    assert "moe_tp_extend_ep" not in str(refused.value) and "capacity_factor" in str(refused.value)
    # without replay a capacity factor is the MoE's own business
    build_plan(engine(override_transformer_config={"moe_expert_capacity_factor": 1.0}), optim(), GLM5, "ascend")


@pytest.mark.parametrize("key", ["moe_permute_fusion", "use_fused_moe_token_permute_and_unpermute"])
def test_mindspeed_moe_features_that_cannot_build_over_megatron_0_18_are_refused_on_ascend(key):
    with pytest.raises(BuildPlanError, match=rf"{key}=True with the all-to-all dispatcher: .*pg_collection"):
        build_plan(engine(override_transformer_config={key: True}), optim(), GLM5, "ascend")
    with pytest.raises(BuildPlanError, match=r"moe_tp_extend_ep=True: .*ModuleNotFoundError"):
        build_plan(engine(override_transformer_config={"moe_tp_extend_ep": True}), optim(), GLM5, "ascend")
    allgather = {key: True, "moe_token_dispatcher_type": "allgather"}
    build_plan(engine(override_transformer_config=allgather), optim(), GLM5, "ascend")
    build_plan(engine(override_transformer_config={key: True}), optim(), GLM5, "cuda")


def test_an_unknown_replay_mode_is_left_to_verls_own_config_check():
    plan = build_plan(engine(router_replay={"mode": "R4"}), optim(), GLM5, "cpu")
    assert "router_replay_padded" not in plan.features
