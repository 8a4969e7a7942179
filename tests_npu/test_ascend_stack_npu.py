"""The Ascend stack as the GLM-5.2 example runs it, on an Ascend node with the verl-npu image (npu tier).

What only a node can show: that MindSpeed applies absorbed MLA, its fused DSA operators and the
kv-allgather CP bypass from the arguments the engine's build plan hands ``repatch``, and that vLLM's
sleep-mode allocator starts in the image's environment. Skipped elsewhere (conftest.py).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.npu


def _example_plan():
    from transformers import GlmMoeDsaConfig

    from verl_npu.contracts.mindspeed import DSA_CP_ALGORITHM, DSA_SWITCHES
    from verl_npu.engine.build_plan import build_plan

    engine = {
        "vanilla_mbridge": True,
        "tensor_model_parallel_size": 2,
        "context_parallel_size": 4,
        "override_transformer_config": {**dict.fromkeys(DSA_SWITCHES, True), "context_parallel_algo": DSA_CP_ALGORITHM},
    }
    return build_plan(engine, {}, GlmMoeDsaConfig(), "ascend")


def test_mindspeed_applies_absorption_fused_dsa_and_kv_allgather_cp_from_the_build_plan():
    pytest.importorskip("mindspeed", reason="MindSpeed is installed in the verl-npu Ascend images only")
    from mindspeed.megatron_adaptor import repatch

    plan = _example_plan()
    assert {"dsa_absorbed_mla", "dsa_fused_operators", "dsa_cp_kvallgather"} <= set(plan.features)
    repatch(dict(plan.mindspeed_repatch))

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.experimental_attention_variant import dsa

    assert dsa.DSAttention.forward.__module__.endswith("dsa_npu_fused"), dsa.DSAttention.forward.__module__
    assert dsa.DSAIndexer.forward_with_scores.__module__.endswith("dsa_npu_fused")
    assert multi_latent_attention.MLASelfAttention.__name__ == "MLASelfAttentionAbsorb"

    # megatron-core 0.18 asserts CP == 1 for DSA; MindSpeed's kv-allgather wrapper lets the config build
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tf = dict(plan.transformer_overrides)
    config = MLATransformerConfig(
        num_layers=2, hidden_size=6144, num_attention_heads=64, tensor_model_parallel_size=2,
        context_parallel_size=4, q_lora_rank=2048, kv_lora_rank=512, qk_head_dim=192, qk_pos_emb_head_dim=64,
        v_head_dim=256, normalization="RMSNorm", **tf,
    )  # fmt: skip
    assert config.context_parallel_size == 4 and config.experimental_attention_variant == "dsa"
    assert config.use_fused_lightning_indexer is True  # MindSpeed copies its args onto the config


def test_vllm_sleep_mode_allocator_starts_in_the_image_environment(monkeypatch):
    pytest.importorskip("vllm_ascend", reason="vllm-ascend is installed in the verl-npu Ascend images only")
    from vllm_ascend.device_allocator.camem import CaMemAllocator

    from verl_npu.contracts.vllm_ascend import ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS

    assert EXPANDABLE_SEGMENTS not in os.environ.get(ALLOC_CONF_VARIABLE, ""), "the image sets expandable segments"
    monkeypatch.setattr(CaMemAllocator, "instance", None)
    assert CaMemAllocator.get_instance() is not None
    monkeypatch.setattr(CaMemAllocator, "instance", None)
    monkeypatch.setenv(ALLOC_CONF_VARIABLE, EXPANDABLE_SEGMENTS)
    with pytest.raises(AssertionError, match="Expandable segments"):
        CaMemAllocator.get_instance()
