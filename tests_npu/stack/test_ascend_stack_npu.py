"""The Ascend stack as the GLM-5.2 example runs it, on an Ascend node with the verl-npu image (npu tier).

What only a node can show: that MindSpeed applies absorbed MLA, its fused DSA operators and the
kv-allgather CP bypass from the arguments the engine's build plan hands ``repatch``; that GLM-5.2's
IndexShare runs on MindSpeed's fused path (full layers publish the fused indexer's top-k, shared
layers hand it to the fused sparse attention); and that vLLM's sleep-mode allocator starts in the
image's environment. Skipped elsewhere (conftest.py).
"""

from __future__ import annotations

import json
import os

import pytest
from support.paths import REPO

pytestmark = pytest.mark.npu


def _example_plan(hf_config=None, tp: int = 2, cp: int = 4):
    from transformers import GlmMoeDsaConfig

    from verl_npu.contracts.mindspeed import DSA_CP_ALGORITHM, DSA_SWITCHES
    from verl_npu.engine.build_plan import build_plan

    engine = {
        "vanilla_mbridge": True,
        "tensor_model_parallel_size": tp,
        "context_parallel_size": cp,
        "override_transformer_config": {**dict.fromkeys(DSA_SWITCHES, True), "context_parallel_algo": DSA_CP_ALGORITHM},
    }
    return build_plan(engine, {}, hf_config or GlmMoeDsaConfig(), "ascend")


def _one_layer_per_kind_glm5_2():
    """GLM-5.2's published architecture (examples/glm5_2/config.json) cut to 4 layers (full, full, full, shared)
    and 8 experts, keeping every shape the fused operators check; index_topk 1024 < the 2048-token sequence."""
    from transformers import GlmMoeDsaConfig

    published = json.loads((REPO / "examples/glm5_2/config.json").read_text())
    return GlmMoeDsaConfig.from_dict(
        {
            **published, "num_hidden_layers": 4, "indexer_types": ["full", "full", "full", "shared"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "first_k_dense_replace": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 4096, "index_topk": 1024,
        }
    )  # fmt: skip


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


def test_index_share_runs_on_mindspeeds_fused_dsa_path():
    """One NPU, MindSpeed's fused DSA (absorbed MLA, lightning indexer, sparse flash attention, KL loss) from the
    build plan: the shared layer attends over the full layer's top-k from the fused indexer, in training and
    in the no-grad log-prob pass, and a full recompute gives the same loss."""
    pytest.importorskip("mindspeed", reason="MindSpeed is installed in the verl-npu Ascend images only")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from mindspeed.megatron_adaptor import repatch

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches, IndexShare's MindSpeed wraps among them)
    from verl_npu.engine import index_share
    from verl_npu.testing.glm5_model import build_glm5_model

    hf = _one_layer_per_kind_glm5_2()
    plan = _example_plan(hf, tp=1, cp=1)
    assert {"dsa_absorbed_mla", "dsa_fused_operators"} <= set(plan.features)
    repatch(dict(plan.mindspeed_repatch))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("hccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    try:

        def build(**overrides):
            torch.manual_seed(0)
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            fields = dict(plan.transformer_overrides) | dict(params_dtype=torch.bfloat16, bf16=True) | overrides
            return build_glm5_model(hf, fused_rmsnorm=True, **fields).npu()

        net = build()
        source, shared, _ = index_share.classes()
        attentions = [layer.self_attention.core_attention for layer in net.decoder.layers]
        assert [type(a) for a in attentions] == [source, source, source, shared]
        assert not [n for n, _ in net.decoder.layers[3].named_parameters() if ".indexer." in n]
        tokens = torch.randint(0, hf.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(1)).npu()
        positions = torch.arange(2048).unsqueeze(0).npu()

        with index_share.record_topk() as trace:
            loss = net(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert {n: kind for n, (kind, _) in trace.items()} == {1: "full", 2: "full", 3: "full", 4: "shared"}
        assert trace[3][1].shape[-1] == hf.index_topk
        assert torch.equal(trace[4][1], trace[3][1])

        net.eval()
        with torch.no_grad(), index_share.record_topk() as eval_trace:
            net(tokens, positions, None)
        assert torch.equal(eval_trace[4][1], eval_trace[3][1])
        agreement = (eval_trace[3][1].sort(-1).values == trace[3][1].sort(-1).values).float().mean().item()
        assert agreement > 0.99, agreement  # the same fused indexer, with and without the KL-loss operator

        recomputed = build(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        recomputed.load_state_dict(net.state_dict())
        again = recomputed(tokens, positions, None, labels=tokens).float().mean()
        again.backward()
        torch.testing.assert_close(again, loss.detach(), rtol=1e-3, atol=0)
    finally:
        parallel_state.destroy_model_parallel()
