"""The engine's build plan, rule by rule, on verl's own config dataclasses and transformers' GLM-5 config."""

from __future__ import annotations

import pytest
from transformers import GlmMoeDsaConfig, LlamaConfig
from verl.workers.config import McoreEngineConfig, McoreOptimizerConfig

from verl_npu.engine.build_plan import BuildPlanError, build_plan


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


@pytest.mark.parametrize(
    ("platform", "impl"), [("ascend", "torch_npu.npu_rms_norm"), ("cuda", "verl_npu.ops.rmsnorm.RMSNorm")]
)
def test_fused_rmsnorm_maps_per_platform(platform, impl):
    plan = build_plan(engine(override_transformer_config={"use_fused_rmsnorm": True}), optim(), LLAMA, platform)
    assert "fused_rmsnorm" in plan.features and plan.rmsnorm_impl == impl
    assert plan.transformer_overrides["normalization"] == "RMSNorm"
    assert "use_fused_rmsnorm" not in plan.transformer_overrides  # not a megatron-core field
    if platform == "ascend":
        assert plan.mindspeed_repatch["use_fused_rmsnorm"] is True


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


def test_fused_dsa_flags_go_together():
    otc = {"use_fused_lightning_indexer": True, "use_fused_sparse_flash_attention": True}
    with pytest.raises(
        BuildPlanError,
        match=r"only work together.*also set override_transformer_config\.use_fused_lightning_indexer_kl_loss=True",
    ):
        build_plan(engine(override_transformer_config=otc), optim(), GLM5, "ascend")
    all_three = {**otc, "use_fused_lightning_indexer_kl_loss": True}
    plan = build_plan(engine(override_transformer_config=all_three), optim(), GLM5, "ascend")
    assert "dsa_fused_ascend" in plan.features and plan.mindspeed_repatch["use_fused_lightning_indexer"] is True
    cuda = build_plan(engine(override_transformer_config=all_three), optim(), GLM5, "cuda")
    assert "dsa_fused_ascend" not in cuda.features and any("portable path" in n for n in cuda.notes)


def test_fused_kl_loss_needs_32_64_or_128_indexer_heads():
    otc = dict.fromkeys(
        ("use_fused_lightning_indexer", "use_fused_sparse_flash_attention", "use_fused_lightning_indexer_kl_loss"), True
    )
    odd = GlmMoeDsaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, index_n_heads=16)
    with pytest.raises(BuildPlanError, match="dsa_indexer_n_heads=16: the fused indexer KL loss supports 32, 64, 128"):
        build_plan(engine(override_transformer_config=otc), optim(), odd, "ascend")


def test_fused_dsa_flags_without_dsa_are_an_error():
    with pytest.raises(BuildPlanError, match="fused DSA operators need a DSA model"):
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
