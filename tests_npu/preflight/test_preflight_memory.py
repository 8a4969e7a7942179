"""Preflight memory estimator: parameter counts against real transformers models, and the estimator's arithmetic.

The estimator's agreement with what megatron-core really allocates is measured on a GPU by
bench/memory_estimate.py (bench/results/memory_estimate_h200.json); here the counts and the
bookkeeping (sharding, precision, recompute, offload, nodes) are checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.paths import REPO

from verl_npu.engine.host_arena import next_power_of_two, power_of_two_chunks
from verl_npu.parallelism import Parallelism, ParallelismError
from verl_npu.preflight.memory import Activations, GiB, Offload, Precision, estimate, node_stages
from verl_npu.preflight.model_shape import ModelShape

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=88, num_attention_heads=8, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)
MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
TINY_HF = {
    "llama": dict(COMMON, num_hidden_layers=3, tie_word_embeddings=True),
    "qwen2": dict(COMMON, num_hidden_layers=2),
    "qwen3": dict(COMMON, num_hidden_layers=2, head_dim=24),
    "qwen3_moe": dict(
        COMMON, **MOE, num_hidden_layers=4, head_dim=16, num_experts=6, decoder_sparse_step=2, mlp_only_layers=[3]
    ),
    "deepseek_v3": dict(
        COMMON,
        **MOE,
        **MLA,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "glm_moe_dsa": dict(
        COMMON,
        **MOE,
        **MLA,
        num_hidden_layers=4,
        num_attention_heads=4,
        n_routed_experts=6,
        n_shared_experts=1,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
    ),
}


@pytest.mark.parametrize("model_type", list(TINY_HF))
def test_parameter_counts_equal_a_real_transformers_model(model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY_HF[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf(config)
    assert shape == ModelShape.from_hf({"model_type": model_type, **TINY_HF[model_type]})  # dict: same defaults

    for i, layer in enumerate(model.model.layers):
        counted = shape.layer_params(i)
        real_experts = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n)
        assert counted.dense + counted.expert == sum(p.numel() for p in layer.parameters()), f"layer {i}"
        assert counted.expert == real_experts, f"layer {i}"
    assert shape.embedding_params() == model.model.embed_tokens.weight.numel()
    lm_head = model.lm_head.weight
    tied = lm_head.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shape.output_params() == (0 if tied else lm_head.numel())
    assert shape.total_params() == sum(p.numel() for p in model.parameters())  # final norm included


def test_moe_layers_follow_each_familys_rule():
    assert ModelShape.from_hf({"model_type": "qwen3_moe", **TINY_HF["qwen3_moe"]}).is_moe == (False, True, False, False)
    assert ModelShape.from_hf({"model_type": "deepseek_v3", **TINY_HF["deepseek_v3"]}).is_moe == (False, True, True)
    glm = ModelShape.from_hf({"model_type": "glm_moe_dsa", **TINY_HF["glm_moe_dsa"]})
    assert glm.is_moe == (False, True, False, True)
    assert glm.dsa and glm.mla


def test_glm5_defaults_are_744b_total_40b_active():
    shape = ModelShape.from_hf("glm5")
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers, shape.num_attention_heads) == (154880, 6144, 78, 64)
    assert (shape.num_experts, shape.router_topk, shape.moe_ffn_hidden_size) == (256, 8, 2048)
    assert (shape.kv_lora_rank, shape.q_lora_rank, shape.index_topk, shape.index_n_heads) == (512, 2048, 2048, 32)
    assert shape.is_moe.count(True) == 75  # transformers: the first 3 layers dense
    assert 740e9 < shape.total_params() < 748e9
    non_embedding = shape.active_params() - shape.embedding_params() - shape.output_params()
    assert 39e9 < non_embedding < 41e9


def test_config_from_a_path_and_offline_model_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **TINY_HF["qwen2"]}))
    assert ModelShape.from_hf(tmp_path) == ModelShape.from_hf(tmp_path / "config.json")
    assert ModelShape.from_hf(tmp_path).qkv_bias  # qwen2's q/k/v biases, from transformers' family defaults
    with pytest.raises(ValueError, match="locally cached"):
        ModelShape.from_hf("no-such-org/no-such-model-for-preflight")


def test_unknown_model_type_names_the_missing_key():
    cfg = {"model_type": "mystery", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=r"num_attention_heads=None: expected a value \(it is missing\)"):
        ModelShape.from_dict(cfg)
    with pytest.raises(ValueError, match="moe_intermediate_size=None: expected a value"):
        ModelShape.from_dict({**cfg, "num_attention_heads": 2, "intermediate_size": 16, "num_experts": 4})
    shape = ModelShape.from_dict({**cfg, "num_attention_heads": 2, "intermediate_size": 16})
    assert shape.total_params() == 10 * 8 * 2 + 2 * (4 * 8 * 8 + 3 * 8 * 16 + 2 * 8) + 8


# --- the estimator ---------------------------------------------------------------------------------
# 4 layers of h=64, f=128, 4 heads (2 kv groups of 16): 36,992 params a layer, by hand
DENSE = ModelShape.from_dict(
    dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
         num_attention_heads=4, num_key_value_heads=2)
)  # fmt: skip
DENSE_PARAMS = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 1000 * 64 + 64
TINY_MOE = ModelShape.from_hf({"model_type": "qwen3_moe", **TINY_HF["qwen3_moe"]})
NO_OVERHEAD = dict(overhead_bytes=0)


def test_hand_counted_static_state_and_distributed_optimizer_divides_by_dp():
    assert DENSE.total_params() == DENSE_PARAMS == 276_032
    one = estimate(DENSE, Parallelism(world=1), **NO_OVERHEAD).stages[0]
    assert (one.train["weights"], one.train["grads"], one.train["optimizer"]) == (
        2 * DENSE_PARAMS,  # bf16
        4 * DENSE_PARAMS,  # fp32 grad buffer (grad_reduce_in_fp32)
        12 * DENSE_PARAMS,  # fp32 main params + exp_avg + exp_avg_sq
    )
    four = estimate(DENSE, Parallelism(world=4), **NO_OVERHEAD).stages[0]
    assert four.train["optimizer"] * 4 == one.train["optimizer"]
    assert four.train["weights"] == one.train["weights"] and four.train["grads"] == one.train["grads"]
    cp = estimate(DENSE, Parallelism(world=8, cp=2), **NO_OVERHEAD).stages[0]  # shards over dp x cp = 8
    assert cp.train["optimizer"] * 8 == one.train["optimizer"]
    plain = estimate(DENSE, Parallelism(world=4), Precision(use_distributed_optimizer=False)).stages[0]
    assert plain.train["optimizer"] == one.train["optimizer"]


def test_experts_shard_over_ep_and_their_optimizer_over_expert_dp():
    ep1 = estimate(TINY_MOE, Parallelism(world=4), **NO_OVERHEAD).stages[0]
    ep2 = estimate(TINY_MOE, Parallelism(world=4, ep=2), **NO_OVERHEAD).stages[0]
    experts = sum(TINY_MOE.layer_params(i).expert for i in range(TINY_MOE.num_layers))
    assert experts == 6 * 3 * 64 * 24
    assert ep1.params - ep2.params == experts // 2
    assert ep1.train["weights"] - ep2.train["weights"] == 2 * (experts // 2)
    dense = TINY_MOE.total_params() - experts
    # dense state over dp = 4; expert state over expert-dp = world / (pp * ep * etp): 4 with ep=1, 2 with ep=2
    assert ep1.train["optimizer"] == 12 * dense // 4 + 12 * experts // 4
    assert ep2.train["optimizer"] == 12 * dense // 4 + 12 * (experts // 2) // 2
    with pytest.raises(ValueError, match="EP 4 does not divide the model's 6 routed experts"):
        estimate(TINY_MOE, Parallelism(world=4, ep=4))


def test_precision_aware_optimizer_bf16_moments_halve_moment_bytes():
    base = estimate(DENSE).stages[0].train["optimizer"]
    bf16 = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    no_remainders = estimate(DENSE, precision=Precision(**bf16, store_param_remainders=False)).stages[0]
    moments = 8 * DENSE_PARAMS  # two fp32 moments
    assert no_remainders.train["optimizer"] == 4 * DENSE_PARAMS + moments // 2 == base - moments // 2
    remainders = estimate(DENSE, precision=Precision(**bf16)).stages[0]  # int16 remainders of the fp32 master
    assert remainders.train["optimizer"] == 6 * DENSE_PARAMS
    assert "int16" in remainders.details["optimizer"]
    bf16_grads = estimate(DENSE, precision=Precision(**bf16, main_grads_dtype="bf16")).stages[0]
    assert bf16_grads.train["grads"] == 2 * DENSE_PARAMS


def test_full_recompute_reduces_activations_and_flash_drops_the_score_buffers():
    def acts(**kw):
        stage = estimate(DENSE, activations=Activations(seq_len=2048, **kw)).stages[0]
        return stage.train["activations"], stage.train["workspace"]

    unfused, workspace = acts(attention_kernel="unfused")
    assert workspace == 2 * 4 * 2048 * 2048  # megatron's [b * heads, s, s] bf16 buffer
    full, _ = acts(attention_kernel="unfused", recompute_granularity="full", recompute_method="uniform")
    selective, _ = acts(attention_kernel="unfused", recompute_granularity="selective")
    flash, none = acts(attention_kernel="flash")
    assert full < selective < unfused and flash < unfused and none == 0
    assert acts(attention_kernel="unfused", micro_batch_size=2)[0] > unfused


def test_param_offload_floor_excludes_weights_and_grads_and_host_holds_what_left():
    stage = estimate(DENSE, offload=Offload(param_offload=True), platform="cuda").stages[0]
    assert stage.floor["weights"] == stage.floor["grads"] == 0
    assert stage.floor_bytes == stage.train["optimizer"] + stage.train["workspace"] + 2 * GiB
    assert stage.host_bytes == stage.train["weights"]  # grads are released, not copied
    both = estimate(DENSE, offload=Offload(param_offload=True, optimizer_offload=True), platform="cuda").stages[0]
    assert both.floor_bytes == both.train["workspace"] + 2 * GiB
    assert both.host_bytes == both.train["weights"] + both.train["optimizer"]


def test_host_ram_on_ascend_is_each_arenas_power_of_two_chunks_not_one_rounded_block():
    """torch_npu's pinned allocator rounds a block up to a power of two; the manager's chunks sum to the need."""
    both = Offload(param_offload=True, optimizer_offload=True)
    ascend = estimate(DENSE, offload=both, platform="ascend").stages[0]
    weights, optimizer = ascend.train["weights"], ascend.train["optimizer"]
    chunks = power_of_two_chunks(weights).nbytes + power_of_two_chunks(optimizer).nbytes
    assert ascend.host_bytes == chunks
    assert weights + optimizer < chunks < weights + optimizer + 2 * 4096  # < one page per arena over the need
    assert chunks < next_power_of_two(weights) + next_power_of_two(optimizer)  # what one block each would lock
    assert estimate(DENSE, offload=both).stages[0].host_bytes == chunks  # Ascend is the default
    assert "chunked on ascend" in ascend.details["host"]
    for platform in ("cuda", "cpu"):  # one exact allocation each
        assert estimate(DENSE, offload=both, platform=platform).stages[0].host_bytes == weights + optimizer
    assert estimate(DENSE, platform="ascend").stages[0].host_bytes == 0  # nothing offloaded
    with pytest.raises(ValueError, match="platform 'npu'"):
        estimate(DENSE, platform="npu")


def launch_estimate(optim: dict, platform: str = "ascend", **megatron):
    """preflight's memory estimate of a one-device launch of DENSE, through the actor's build plan on ``platform``."""
    from verl_npu.engine.build_plan import build_plan
    from verl_npu.preflight.memory_plan import estimate_launch
    from verl_npu.preflight.target import target
    from verl_npu.preflight.values import read_launch

    megatron = {"vanilla_mbridge": True, **megatron}
    config = {
        "actor_rollout_ref": {
            "actor": {
                "strategy": "megatron",
                "megatron": megatron,
                "optim": optim,
                "ppo_micro_batch_size_per_gpu": 1,
                "ppo_mini_batch_size": 2,
            },
            "rollout": {"n": 1, "gpu_memory_utilization": 0.5},
        },
        "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 64},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 8},
    }
    values, checks = read_launch(config)  # the typed view preflight's steps read
    assert values is not None, checks
    mesh = Parallelism(world=1)
    plan = build_plan(megatron, optim, {"rms_norm_eps": 1e-6}, platform)
    return estimate_launch(values, DENSE, mesh, plan, target("a3", platform))[0]


def test_a_launch_estimate_counts_host_ram_on_its_platform():
    host = {
        platform: launch_estimate({}, platform, param_offload=True, optimizer_offload=True).stages[0].host_bytes
        for platform in ("ascend", "cuda")
    }
    stage = estimate(DENSE, offload=Offload(True, True), platform="cuda").stages[0]
    assert host["cuda"] == stage.train["weights"] + stage.train["optimizer"]
    assert host["ascend"] == sum(power_of_two_chunks(stage.train[k]).nbytes for k in ("weights", "optimizer"))


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "32", "float32"])
def test_the_launch_estimate_counts_each_moment_dtype_spelling_the_build_plan_accepts(spelling):
    """One alias table (verl_npu.dtypes): a bf16 moment is 2 bytes in the estimate, however it is spelled."""
    from verl_npu.dtypes import nbytes

    optim = {"use_precision_aware_optimizer": True, "exp_avg_dtype": spelling}
    stage = launch_estimate(optim, "ascend").stages[0]
    # int16 main-param remainders (bf16 params), exp_avg in ``spelling``, fp32 exp_avg_sq; one rank: no sharding
    assert stage.train["optimizer"] == stage.params * (2 + nbytes(spelling) + 4)


def test_host_ram_per_node_sums_the_ranks_of_two_stages():
    # tp=2 pp=4 on 8 ranks, 4 devices a node: node 0 holds ranks 0-3 = stages 0 and 1, node 1 stages 2 and 3
    par = Parallelism(world=8, tp=2, pp=4, first_stage_layers=1)
    assert par.stage_layers(4) == [1, 1, 1, 1] and node_stages(par, devices_per_node=4) == [(0, 1), (2, 3)]
    result = estimate(DENSE, par, offload=Offload(param_offload=True, optimizer_offload=True), devices_per_node=4)
    host = [s.host_bytes for s in result.stages]
    assert host[0] != host[1]  # the first stage also holds the embedding
    assert result.host_bytes_per_node == max(2 * host[0] + 2 * host[1], 2 * host[2] + 2 * host[3])
    assert result.worst_node_stages == ((0, 1) if result.worst_node == 0 else (2, 3))


def test_uneven_pipeline_stages_and_invalid_meshes():
    par = Parallelism(world=16, tp=2, pp=8, first_stage_layers=9, last_stage_layers=9)
    assert par.stage_layers(78) == [9] + [10] * 6 + [9]
    with pytest.raises(ValueError, match="do not split"):
        Parallelism(world=3, pp=3).stage_layers(4)
    with pytest.raises(ParallelismError, match="world size 4 is not divisible by PP 1 x EP 3 x ETP 1 = 3") as error:
        estimate(DENSE, Parallelism(world=4, tp=2, ep=3))
    assert [p.check for p in error.value.problems] == ["ep", "ep-dense"]


# --- GLM-5 on 32 A3 nodes (the public layout) -------------------------------------------------------
GLM5_MESH = Parallelism(
    world=512, tp=2, pp=8, cp=4, ep=64, etp=1, sequence_parallel=True, first_stage_layers=9, last_stage_layers=9
)
GLM5_ACTS = Activations(
    micro_batch_size=1, seq_len=32768, recompute_granularity="full", recompute_method="uniform",
    recompute_num_layers=1, attention_kernel="flash",
)  # fmt: skip
PRECISION_AWARE = Precision(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
A3_HBM = 64 * GiB


def glm5(precision: Precision, offload: bool, utilization: float | None = 0.5):
    return estimate(
        ModelShape.from_hf("glm5"), GLM5_MESH, precision, GLM5_ACTS, Offload(offload, offload),
        capacity_bytes=A3_HBM, rollout_gpu_memory_utilization=utilization,
    )  # fmt: skip


def test_glm5_public_a3_layout_fits_with_offload_and_the_precision_aware_optimizer():
    result = glm5(PRECISION_AWARE, offload=True)
    print(result.summary())
    assert [s.layers for s in result.stages] == [9, 10, 10, 10, 10, 10, 10, 9]
    assert result.fits
    for stage in result.stages:
        assert stage.train_bytes < A3_HBM, stage.stage
        assert "dp*cp=32" in stage.details["optimizer"] and "expert-dp=1" in stage.details["optimizer"]
    # host RAM: a node is 16 ranks of one stage; every rank's bf16 params + optimizer state is in host arenas
    worst = result.stages[result.worst_node_stages[0]]
    assert result.worst_node_stages == (result.worst_node // 4,)
    assert result.host_bytes_per_node == 16 * worst.host_bytes


def test_a_plan_that_exceeds_hbm_without_offload_fits_with_it():
    without = glm5(Precision(), offload=False)
    print(without.summary())
    assert not without.fits
    assert all(without.headroom(s)["train"] >= 0 for s in without.stages)  # the training step itself fits
    assert any(without.headroom(s)["rollout"] < 0 for s in without.stages)  # actor state + vLLM's 50% do not
    with_offload = glm5(Precision(), offload=True)
    assert with_offload.fits
    assert all(with_offload.headroom(s)["rollout"] >= 0 for s in with_offload.stages)


def test_dsa_attention_holds_no_s_by_s_buffer_on_either_verl_npu_path():
    """DSAttention replaces megatron's DotProductAttention; fused (MindSpeed) or chunked (verl-npu's patches)."""
    from transformers import GlmMoeDsaConfig

    from verl_npu.ops.chunking import DSA_ATTENTION_CHUNK_ELEMENTS

    glm5 = ModelShape.from_hf(GlmMoeDsaConfig())  # 64 heads, 32 indexer heads

    def activations(seq_len, **kw):
        act = Activations(seq_len=seq_len, num_microbatches=1, **kw)
        return estimate(glm5, Parallelism(world=104, tp=8, pp=13, ep=8), activations=act).stages[1].train["activations"]

    for kernel in ("fused", "chunked"):
        for attention in ("flash", "unfused"):  # DotProductAttention's kernel does not apply to DSA layers
            short, long = activations(16384, dsa_kernel=kernel), activations(32768, dsa_kernel=kernel)
            assert activations(32768, dsa_kernel=kernel, attention_kernel=attention) == long
            assert 1.9 < long / short < 2.1, (kernel, long / short)  # linear in s: no [s, s] term
    # the two differ by the fused operators' saved softmax statistics against one chunk's working set
    # (at most four fp32 score-sized tensors of the attention's chunk budget), not by any [s, s] buffer
    chunked, fused = activations(32768, dsa_kernel="chunked"), activations(32768, dsa_kernel="fused")
    assert chunked != fused and abs(chunked - fused) <= 4 * 4 * DSA_ATTENTION_CHUNK_ELEMENTS
    with pytest.raises(ValueError, match="dsa_kernel 'dense': use 'fused' or 'chunked'"):
        activations(1024, dsa_kernel="dense")


# --- GLM-5.2: IndexShare's shared DSA layers and the pipeline top-k carry -----------------------------------
EXAMPLE_CONFIG = REPO / "examples" / "glm5_2" / "config.json"


def test_shared_layers_hold_no_indexer_unlike_transformers_modules():
    """transformers 5.10.4 builds an (unused) indexer on shared layers; the published checkpoint and the engine have
    none, so the count is the real model's minus those indexers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kinds = ["full", "shared", "full", "shared"]
    hf = dict(TINY_HF["glm_moe_dsa"], indexer_types=kinds)
    config = AutoConfig.for_model("glm_moe_dsa", **hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_hf(config)
    assert shape.indexer_kinds() == tuple(kinds) and shape.shared_layers == 2
    for i, layer in enumerate(model.model.layers):
        indexer = sum(p.numel() for n, p in layer.named_parameters() if ".indexer." in n)
        assert indexer == shape.indexer_params() > 0  # transformers: one on every layer
        real = sum(p.numel() for p in layer.parameters())
        counted = shape.layer_params(i)
        assert counted.dense + counted.expert == real - (indexer if kinds[i] == "shared" else 0), f"layer {i}"
    assert shape.total_params() == sum(p.numel() for p in model.parameters()) - 2 * shape.indexer_params()


def test_the_glm5_2_fallback_is_the_published_architecture():
    """Preflight's "glm5.2" (name fallback) equals examples/glm5_2/config.json: 21 full / 57 shared indexers."""
    from verl_npu.preflight.model_shape import load_config

    glm52, published = ModelShape.from_hf("glm5.2"), ModelShape.from_hf(EXAMPLE_CONFIG)
    assert glm52 == published
    kinds = glm52.indexer_kinds()
    assert kinds.count("full") == 21 and kinds.count("shared") == 57
    assert [i for i, k in enumerate(kinds) if k == "full"][:6] == [0, 1, 2, 6, 10, 14]
    glm5 = ModelShape.from_hf("glm5")
    assert glm5.indexer_kinds() == ("full",) * 78 and glm5.indexer_full == ()
    assert glm5.total_params() - glm52.total_params() == 57 * glm52.indexer_params()
    fallback, config = load_config("glm5.2"), load_config(EXAMPLE_CONFIG)
    for key in ("indexer_types", "rope_parameters", "max_position_embeddings", "num_nextn_predict_layers",
                "moe_router_dtype", "routed_scaling_factor", "index_topk_freq", "index_skip_topk_offset"):  # fmt: skip
        assert fallback[key] == config[key], key


def test_a_shared_layer_saves_neither_indexer_activations_nor_a_top_k():
    from verl_npu.preflight.memory import _attention, _Sizes

    glm52 = ModelShape.from_hf("glm5.2")
    z = _Sizes(s=8192, b=1, t=2, sp=2, etp=1, seq=32768)  # CP 4 of a 32k sequence
    act = Activations(seq_len=32768)
    full, shared = _attention(glm52, z, act, indexer=True), _attention(glm52, z, act, indexer=False)
    n, d = glm52.index_n_heads, glm52.index_head_dim
    indexer = (2 * n * d + 2 * 2 * d + 4 + 2 * n) * 8192  # q, k (+ LayerNorm), head weights
    topk = 8 * 8192 * 2048  # int64 [b, s/cp, min(index_topk, seq)]
    assert full[0] - shared[0] == indexer + topk
    mesh = Parallelism(world=104, tp=8, pp=13, ep=8)
    stage = estimate(glm52, mesh, activations=act).stages[1]
    glm5_stage = estimate(ModelShape.from_hf("glm5"), mesh, activations=act).stages[1]
    assert stage.train["activations"] < glm5_stage.train["activations"]


def _glm52(acts: Activations, parallelism: Parallelism = GLM5_MESH):
    return estimate(ModelShape.from_hf(EXAMPLE_CONFIG), parallelism, PRECISION_AWARE, acts, Offload(True, True),
                    capacity_bytes=A3_HBM, rollout_gpu_memory_utilization=0.8)  # fmt: skip


def test_the_carry_under_full_recompute_keeps_the_top_k_that_chunks_starting_shared_read():
    result = _glm52(GLM5_ACTS)  # the example's layout: PP 8 (9 + 6 x 10 + 9), CP 4, 32k tokens, full recompute
    print(result.summary())
    topk = 8 * 1 * (32768 // 4) * 2048  # int64 [b, s/cp, min(index_topk, seq)]: 128 MiB
    message = 3 * 8 + 4 * 1 * (32768 // 4) * 2048  # int64 header + int32 top-k: 64 MiB
    full = [[0, 1, 2, 6], [10, 14, 18], [22, 26], [30, 34, 38], [42, 46], [50, 54, 58], [62, 66], [70, 74]]
    # one-layer chunks: every shared layer starts one and reads the latest top-k (received, or a full layer's on
    # the stage); stage 0 keeps layers 2 and 6's, stage 1 the received one and layers 10 and 14's (18 is last)
    kept = [2, 3, 3, 3, 3, 3, 3, 3]
    for stage, layers, held in zip(result.stages, full, kept, strict=True):
        share = stage.index_share
        p = stage.stage
        assert share.full_layers == tuple(layers)
        assert len(share.full_layers) + len(share.shared_layers) == stage.layers
        assert share.receives == (p > 0) and share.sends == (p < 7)  # every stage after the first starts shared
        assert share.topk_bytes == topk
        in_flight = 8 - p  # 1F1B: min(PP - p, micro-batches)
        assert share.carry_bytes_per_microbatch == held * topk
        assert stage.train["carry"] == share.carry_bytes == in_flight * share.carry_bytes_per_microbatch
        assert stage.floor["carry"] == 0
        assert share.send_bytes_per_microbatch == (message if p < 7 else 0)
        assert share.receive_bytes_per_microbatch == (message if p > 0 else 0)
    assert result.stages[0].train["carry"] == 8 * 2 * topk  # 2 GiB: 2 top-k x 8 micro-batches in flight
    assert result.stages[1].index_share.layout(1) == (
        "stage 1: layers 9-18, full 10, 14, 18; starts shared (carry from stage 0); sends its top-k to stage 2"
    )
    assert "3 int64 top-k of 128.0 MiB per in-flight micro-batch" in result.stages[1].details["carry"]
    assert result.fits
    data = result.to_dict()["stages"][1]
    assert data["index_share"]["receives"] is True and data["dsa_layout"].startswith("stage 1: layers 9-18")
    assert data["train"]["carry"] == result.stages[1].train["carry"]


@pytest.mark.parametrize(
    ("recompute", "receives", "held"),
    [
        (("full", "uniform", 1), False, 2),  # chunks of layers 3, 4, 5 read 2's top-k; 7's reads 6's
        (("full", "uniform", 3), False, 1),  # chunks [0-2] [3-5] [6-7]: only [3-5] starts shared
        (("full", "uniform", 3), True, 1),  # the same chunks: [0-2] starts on a full layer, received is unread
        (("full", "block", 4), False, 1),  # layer 3's chunk; layers 4-7 run unchecked (their top-k: activations)
        ((None, None, None), True, 0),  # stage starting full: the received top-k is never saved
    ],
)
def test_a_chunk_keeps_the_carry_until_backward_only_when_it_starts_shared(recompute, receives, held):
    from verl_npu.preflight.memory import _held_top_k

    full = [True, True, True, False, False, False, True, False]  # GLM-5.2's first 8 layers
    granularity, method, layers = recompute
    act = Activations(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=layers)
    assert _held_top_k(full, receives, act) == held
    assert _held_top_k([True] * 8, receives, act) == 0  # GLM-5: every chunk starts on a full layer
    assert _held_top_k([False, *full[1:]], True, Activations()) == 1  # a stage starting shared keeps the received


def test_without_full_recompute_only_the_received_top_k_is_extra_and_one_micro_batch_keeps_less():
    plain = _glm52(dataclasses.replace(GLM5_ACTS, recompute_granularity=None, recompute_method=None))
    topk = 8 * (32768 // 4) * 2048
    assert plain.stages[0].train["carry"] == 0  # the full layers' top-k are saved activations already
    assert plain.stages[1].train["carry"] == 7 * topk  # the received one, per micro-batch in flight
    single = _glm52(dataclasses.replace(GLM5_ACTS, num_microbatches=1))
    assert single.stages[0].train["carry"] == 2 * topk  # min(PP - p, micro-batches) = 1
    # no carry on a model without IndexShare layers, nor on an interleaved layout (refused where it would carry)
    assert estimate(DENSE).stages[0].index_share is None and estimate(DENSE).stages[0].train["carry"] == 0
    vpp = dataclasses.replace(GLM5_MESH, vpp=2, first_stage_layers=10, last_stage_layers=8)
    interleaved = _glm52(GLM5_ACTS, vpp)
    assert not any(s.index_share.receives or s.index_share.sends for s in interleaved.stages)
