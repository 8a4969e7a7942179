"""GLM-5 (HF ``glm_moe_dsa``) through verl's engine with verl-npu's mbridge bridge, on the CPU harness.

verl 0.9.1 builds the model through mbridge (``vanilla_mbridge=True``); mbridge 0.15.1 has no
``glm_moe_dsa`` bridge, verl-npu registers one (runtime_patches.mbridge_glm5). A tiny GLM-5 (one
dense and one MoE layer, MLA + DSA) is saved by transformers, loaded by the engine on the local
spec, compared with the transformers model, and exported back.

The tiny config declares ``rope_interleave=False`` and ``indexer_rope_interleave=False``: the
installed transformers (5.10) rotates half-split pairs in both its MLA and its indexer whatever the
config says; GLM-5.2's published config sets both flags true (interleaved, megatron's layout). Its index_topk
covers the whole sequence, so DSA keeps every key and the engine's attention equals the dense
causal attention of the HF model; the indexer's scores are compared on their own.
"""

from __future__ import annotations

import collections
import logging
import sys

import pytest
import torch
from support.npu_engine import no_hadamard_shim_afterwards, select_npu_engine  # noqa: F401  (autouse)
from test_verl_engine_path import PROMPT, SEQ, batch

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=SEQ,
    max_position_embeddings=64, tie_word_embeddings=False, rope_interleave=False, indexer_rope_interleave=False,
)  # fmt: skip
# HF weights with rotary rows: their row order depends on the RoPE convention
ROTARY_ROWS = (
    "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight",
    "indexer.k_norm.weight", "indexer.k_norm.bias",
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.glm5_2_checkpoint import sharpened_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GlmMoeDsaConfig, PreTrainedTokenizerFast

    config = GlmMoeDsaConfig(**TINY)
    model = sharpened_model(config, seed=0)
    path = tmp_path_factory.mktemp("glm5")
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t1").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def cpu_engine(model_dir):
    """verl's Megatron engine for the tiny checkpoint at ``model_dir``, built on the CPU through the bridge."""
    from megatron.core import tensor_parallel
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine import EngineRegistry

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=str(model_dir)),
        engine_config=McoreEngineConfig(
            forward_only=False, vanilla_mbridge=True, use_remove_padding=False,  # DSA has no packed (THD) path
            override_transformer_config={
                "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                # the bridge's alltoall dispatcher creates CUDA streams; allgather runs on the CPU and
                # refuses variable sequence lengths (these tests' micro-batches all have one length)
                "moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False,
            },
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, lr_decay_steps=10),
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    engine.initialize()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return engine


@pytest.fixture(scope="module")
def engine(model_dir):
    return cpu_engine(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import GlmMoeDsaForCausalLM

    # eager: transformers' sdpa path adds its boolean causal mask to the float DSA mask, which turns
    # "masked" into +0 instead of -inf, so that reference would attend to future tokens.
    return GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()


def gpt_of(engine):
    inner = engine.module[0]
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def hf_names_of(bridge, model) -> dict[str, list[str]]:
    """Every megatron parameter (and the router's expert-bias buffer) -> its HF names, as mbridge loads them."""
    to_global = bridge._weight_name_mapping_mcore_local_to_global(model)
    return {local: bridge._weight_name_mapping_mcore_to_hf(name) for local, name in to_global.items()}


def interleaved(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The same weight in a checkpoint whose config says interleaved RoPE pairs."""
    rope = TINY["qk_rope_head_dim"]
    if ".indexer." in hf_name:  # per head: [rotary, rest]
        head, start = TINY["index_head_dim"], 0
    elif "q_b_proj" in hf_name:  # per head: [rest, rotary]
        head, start = TINY["qk_nope_head_dim"] + rope, TINY["qk_nope_head_dim"]
    else:  # kv_a_proj_with_mqa: [kv_lora_rank, rotary]
        head, start = TINY["kv_lora_rank"] + rope, TINY["kv_lora_rank"]
    blocks = tensor.reshape(-1, head, *tensor.shape[1:]).clone()
    half_split = blocks[:, start : start + rope]  # pairs (i, i + rope/2) -> (2i, 2i + 1)
    pairs = half_split.reshape(-1, 2, rope // 2, *tensor.shape[1:]).transpose(1, 2)
    blocks[:, start : start + rope] = pairs.reshape(half_split.shape)
    return blocks.reshape(tensor.shape)


# --- registration ---------------------------------------------------------------------------------


def test_glm_moe_dsa_is_registered_once_and_an_upstream_bridge_is_kept(monkeypatch, caplog):
    import mbridge.models
    from mbridge import AutoBridge
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import GlmMoeDsaConfig

    from verl_npu import megatron_adaptor
    from verl_npu.engine.bridges import glm5
    from verl_npu.patching import APPLIED, SKIPPED
    from verl_npu.runtime_patches import mbridge_glm5

    layer = megatron_adaptor.load()
    assert layer.engine.record(mbridge_glm5.PATCH.id).status == APPLIED  # applied when mbridge was imported
    assert mbridge.models.GLM5Bridge is glm5.GLM5Bridge
    assert type(AutoBridge.from_config(GlmMoeDsaConfig(**TINY))) is glm5.GLM5Bridge
    assert layer.engine.apply(mbridge_glm5.PATCH).status == APPLIED and glm5.register() is glm5.GLM5Bridge
    assert [t for t, cls in _MODEL_REGISTRY.items() if cls is glm5.GLM5Bridge] == ["glm_moe_dsa"]

    monkeypatch.delitem(_MODEL_REGISTRY, "glm_moe_dsa")  # mbridge 0.15.1 without the patch
    with pytest.raises(ValueError, match="Unregistered model type: glm_moe_dsa"):
        AutoBridge.from_config(GlmMoeDsaConfig(**TINY))

    class UpstreamGLM5Bridge:  # a future mbridge's own bridge
        pass

    monkeypatch.setitem(_MODEL_REGISTRY, "glm_moe_dsa", UpstreamGLM5Bridge)
    with caplog.at_level(logging.WARNING, logger=glm5.__name__):
        reasons = {mbridge_glm5.PATCH.condition() for _ in range(3)}
        assert glm5.register() is UpstreamGLM5Bridge and _MODEL_REGISTRY["glm_moe_dsa"] is UpstreamGLM5Bridge
    assert reasons == {f"mbridge registers {__name__}.{UpstreamGLM5Bridge.__qualname__} for glm_moe_dsa; kept"}
    logged = [r.getMessage() for r in caplog.records if r.name == glm5.__name__]
    assert len(logged) == 1 and "UpstreamGLM5Bridge" in logged[0], "logged once"
    scratch = type(layer.engine)(layer.platform)  # a fresh process's engine sees mbridge's bridge and skips
    assert scratch.apply(mbridge_glm5.PATCH).status == SKIPPED


# --- config ---------------------------------------------------------------------------------------


def test_config_mapping_follows_glm5_and_agrees_with_the_test_model_mapping():
    from transformers import GlmMoeDsaConfig

    from verl_npu.engine.bridges.glm5 import GLM5Bridge
    from verl_npu.testing.glm5_model import transformer_config_from_hf

    glm5 = GlmMoeDsaConfig(first_k_dense_replace=3)  # GLM-5's shape; mlp_layer_types: 3 dense, then MoE
    config = GLM5Bridge(glm5).config
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size) == (
        78, 6144, 64, 12288
    )  # fmt: skip
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim) == (
        2048, 512, 192, 64
    )  # fmt: skip
    assert config.v_head_dim == 256 and config.qk_layernorm and not config.apply_rope_fusion
    assert (config.rope_type, config.rotary_base, config.multi_latent_attention) == ("rope", 10000.0, True)
    assert config.experimental_attention_variant == "dsa" and config.dsa_indexer_loss_coeff == 0.0
    assert (config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, config.dsa_indexer_topk) == (32, 128, 2048)
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 75
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (256, 8, 2048)
    assert config.moe_shared_expert_intermediate_size == 2048
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert (config.moe_router_topk_scaling_factor, config.moe_router_bias_update_rate) == (2.5, 0.0)
    assert config.moe_router_num_groups is None  # n_group=1: no group-limited routing
    assert config.layernorm_epsilon == 1e-5 and config.normalization == "RMSNorm" and not config.add_bias_linear

    # the GLM-5 test model (verl_npu.testing.glm5_model) builds the same shapes from the same HF config
    ours = GLM5Bridge(GlmMoeDsaConfig(**TINY)).config
    test_model = transformer_config_from_hf(GlmMoeDsaConfig(**TINY))
    shape = (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "q_lora_rank", "kv_lora_rank",
        "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base", "qk_layernorm",
        "apply_rope_fusion", "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
        "dsa_indexer_topk", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_layer_freq", "layernorm_epsilon",
    )  # fmt: skip
    assert {k: getattr(ours, k) for k in shape} == {k: getattr(test_model, k) for k in shape}


def test_config_mapping_refuses_what_megatron_would_compute_differently():
    from transformers import GlmMoeDsaConfig

    from verl_npu.models.glm5.config import glm5_config_fields

    # GLM-5.2's IndexShare maps (the layer specs carry it); only a list the engine cannot build is refused
    glm5_config_fields(GlmMoeDsaConfig(**{**TINY, "indexer_types": ["full", "shared"]}))
    for kinds, match in (
        (["shared", "full"], r"indexer_types\[0\] is 'shared'"),
        (["full"], "for each of the 2 layers"),
        (["full", "sparse"], "'full' or 'shared'"),
    ):
        with pytest.raises(ValueError, match=match):
            glm5_config_fields(GlmMoeDsaConfig(**{**TINY, "indexer_types": kinds}))
    yarn = GlmMoeDsaConfig(**TINY, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
        glm5_config_fields(yarn)
    unnormalised = GlmMoeDsaConfig(**TINY, norm_topk_prob=False)
    with pytest.raises(NotImplementedError, match="norm_topk_prob=False"):
        glm5_config_fields(unnormalised)
    grouped = {**TINY, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4}
    fields = glm5_config_fields(GlmMoeDsaConfig(**grouped, topk_group=2))  # HF: top-2 per group == 4 // 2
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (4, 2)
    with pytest.raises(NotImplementedError, match="top 2"):
        glm5_config_fields(GlmMoeDsaConfig(**grouped, topk_group=1))


# --- weights --------------------------------------------------------------------------------------


def test_every_megatron_weight_maps_to_its_own_checkpoint_tensor_and_was_loaded(engine, checkpoint):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from verl_npu.engine.bridges.glm5 import GLM5Bridge

    gpt = gpt_of(engine)
    assert type(engine.bridge) is GLM5Bridge
    layers = gpt.decoder.layers
    for layer in layers:
        assert isinstance(layer.self_attention.core_attention, DSAttention)
        assert isinstance(layer.self_attention.core_attention.indexer, DSAIndexer)
    assert not isinstance(layers[0].mlp, MoELayer) and isinstance(layers[1].mlp, MoELayer)

    names = hf_names_of(engine.bridge, gpt)
    used = collections.Counter(n for hf in names.values() for n in hf)
    assert set(used) == set(checkpoint), (
        f"unmapped {set(checkpoint) - set(used)}, unknown {set(used) - set(checkpoint)}"
    )
    assert set(used.values()) == {1}, f"used twice: {[n for n, c in used.items() if c > 1]}"
    state = gpt.state_dict()
    for local, hf in names.items():  # a parameter that load_weights skipped keeps its random init
        expected = engine.bridge._weight_to_mcore_format(local, [checkpoint[n] for n in hf])
        assert torch.equal(state[local], expected.to(state[local].dtype)), local

    # the same weights read by hand, without the bridge
    attention, rope = layers[1].self_attention, TINY["qk_rope_head_dim"]
    bf16 = {k: v.to(torch.bfloat16) for k, v in checkpoint.items()}
    assert torch.equal(attention.q_layernorm.weight, bf16["model.layers.1.self_attn.q_a_layernorm.weight"])
    indexer_bias = attention.core_attention.indexer.k_norm.bias  # megatron: [rest, rotary]; HF: [rotary, rest]
    assert torch.equal(indexer_bias[:-rope], bf16["model.layers.1.self_attn.indexer.k_norm.bias"][rope:])
    assert torch.equal(layers[1].mlp.router.expert_bias, checkpoint["model.layers.1.mlp.gate.e_score_correction_bias"])
    fc1 = torch.cat([bf16[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layers[1].mlp.experts.local_experts[3].linear_fc1.weight, fc1)


def test_transformer_engine_names_map_like_the_local_specs(engine):
    """TE's spec names some weights differently (fused norms, grouped experts); they map to the same tensors."""
    gpt = gpt_of(engine)
    te_names = {
        "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
        "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    }
    dense_fused = {"pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # TE fuses it on dense layers
    checked = 0
    for local, hf in hf_names_of(engine.bridge, gpt).items():
        prefix, _, suffix = local.partition(".layers.")
        number, _, rest = suffix.partition(".")
        renames = {**te_names, **(dense_fused if number == "0" else {})}
        if rest in renames:
            te = f"{prefix}.layers.{number}.{renames[rest]}"
        elif ".local_experts." in rest:
            expert, fc = rest.split(".local_experts.")[1].split(".")[:2]
            te = f"{prefix}.layers.{number}.mlp.experts.{fc}.weight{expert}"
        else:
            continue
        assert engine.bridge._weight_name_mapping_mcore_to_hf(te) == hf, te
        checked += 1
    assert checked == 2 * 2 + 1 + 2 * TINY["n_routed_experts"]


def test_export_gives_back_every_checkpoint_tensor(engine, checkpoint):
    """verl's weight sync to the rollout (get_per_tensor_param) exports the checkpoint's names and layouts."""
    per_tensor, _ = engine.get_per_tensor_param()
    exported = dict(per_tensor)
    assert set(exported) == set(checkpoint)
    for name, tensor in exported.items():
        expected = checkpoint[name].to(tensor.dtype)
        assert tensor.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
        assert torch.equal(tensor.cpu(), expected), name


def test_a_checkpoint_with_interleaved_rope_loads_to_the_same_megatron_weights(engine, checkpoint):
    """A config with rope_interleave / indexer_rope_interleave true: same model, other row order."""
    from transformers import GlmMoeDsaConfig

    from verl_npu.engine.bridges.glm5 import GLM5Bridge

    bridge = GLM5Bridge(GlmMoeDsaConfig(**{**TINY, "rope_interleave": True, "indexer_rope_interleave": True}))
    converted = 0
    for local, hf in hf_names_of(engine.bridge, gpt_of(engine)).items():
        if not hf[0].endswith(ROTARY_ROWS):
            continue
        half_split = engine.bridge._weight_to_mcore_format(local, [checkpoint[hf[0]]])
        pairs = interleaved(hf[0], checkpoint[hf[0]])
        assert not torch.equal(pairs, checkpoint[hf[0]])
        assert torch.equal(bridge._weight_to_mcore_format(local, [pairs]), half_split), local
        assert torch.equal(bridge._weight_to_hf_format(local, half_split)[1][0], pairs.to(half_split.dtype)), local
        converted += 1
    assert converted == TINY["num_hidden_layers"] * 6  # q_b, kv_a, wq_b, wk, k_norm weight and bias


RANK_CODE = """
import json, os
import torch
import torch.distributed as dist
import verl_npu.megatron_adaptor  # noqa: F401  (DSA on the local spec and on CPU; the GLM-5 registration)
from verl_npu.testing import cpu_megatron

cpu_megatron.activate()
rank, (tp, ep, etp) = int(os.environ["RANK"]), json.loads(os.environ["LAYOUT"])
dist.init_process_group("gloo", rank=rank, world_size=2)
from megatron.core import parallel_state, tensor_parallel

parallel_state.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
tensor_parallel.model_parallel_cuda_manual_seed(1)
from mbridge import AutoBridge
from safetensors.torch import save_file
from transformers import AutoConfig
from verl_npu.engine.mbridge_local import build_on_local_spec

path = os.environ["MODEL"]
bridge = AutoBridge.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
bridge.set_extra_args(use_cpu_initialization=True, moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
build_on_local_spec(bridge, fused_rmsnorm=True)  # verl-npu's RMSNorm takes sequence-parallel input
models = bridge.get_model(weight_path=path)
exported = {name: tensor.cpu().contiguous() for name, tensor in bridge.export_weights(models)}
if rank == 0:
    save_file(exported, os.environ["EXPORT"])
"""


@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 1)], ids=["tp2-ep2-etp1", "tp2-ep1-etp1"])
def test_two_ranks_load_their_shards_and_export_the_checkpoint(model_dir, checkpoint, layout, tmp_path):
    """Two CPU ranks (gloo): TP=2 with EP=2 (each TP rank holds other experts) or EP=1 (replicated experts).

    mbridge alone scatters the local spec's experts from TP rank 0 (EP=2) and refuses to merge
    replicated experts (EP=1); with the bridge each rank loads its own shards and the export equals the
    checkpoint.
    """
    import json
    import os
    import socket
    import subprocess

    from safetensors.torch import load_file
    from support.paths import TESTS

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    search_path = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {
        **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MODEL": str(model_dir),
        "LAYOUT": json.dumps(layout), "EXPORT": str(tmp_path / "export.safetensors"),
        "PYTHONPATH": os.pathsep.join(search_path),
    }  # fmt: skip
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    ranks = []
    for rank, log in enumerate(logs):
        with log.open("w") as stderr:  # files, not pipes: a full pipe would block a rank
            command = [sys.executable, "-c", RANK_CODE]
            ranks.append(subprocess.Popen(command, env={**env, "RANK": str(rank)}, stderr=stderr))
    for rank, log in zip(ranks, logs, strict=True):
        assert rank.wait(timeout=300) == 0, log.read_text()[-3000:]
    exported = load_file(str(tmp_path / "export.safetensors"))
    assert set(exported) == set(checkpoint)
    for name, tensor in exported.items():
        assert torch.equal(tensor, checkpoint[name].to(tensor.dtype)), name


# --- numerics -------------------------------------------------------------------------------------


def test_engine_log_probs_match_the_hf_model(engine, hf_model):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td, (input_ids, mask) = batch(7, calculate_entropy=False)
    ours = no_padding_2_padding(tu.get(engine.infer_batch(td)["model_output"], "log_probs"), td).float()
    with torch.no_grad():
        logits = hf_model(input_ids, attention_mask=mask).logits[:, PROMPT - 1 : -1].float()
    theirs = torch.log_softmax(logits, -1).gather(-1, input_ids[:, PROMPT:, None]).squeeze(-1)
    valid = mask[:, PROMPT:].bool()
    # bf16 on both sides gives ~3e-3 here; the same weights without the RoPE row conversion give ~0.1
    assert (ours[valid] - theirs[valid]).abs().max() < 0.02, "engine log-probs differ from the HF model's"


def test_the_dsa_indexer_ranks_keys_like_the_hf_indexer(engine, hf_model):
    """With top-k >= the sequence, the HF indexer returns every key in its score order; the engine's
    indexer must score them in the same order (up to bf16 ties)."""
    torch.manual_seed(3)
    x = torch.randn(1, SEQ, TINY["hidden_size"]).to(torch.bfloat16)
    qr = torch.randn(1, SEQ, TINY["q_lora_rank"]).to(torch.bfloat16)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)
    for number in range(TINY["num_hidden_layers"]):
        theirs = hf_model.model.layers[number].self_attn.indexer
        ours = gpt_of(engine).decoder.layers[number].self_attention.core_attention.indexer
        with torch.no_grad():
            cos_sin = hf_model.model.rotary_emb(x, torch.arange(SEQ)[None])
            order = theirs(x, qr, cos_sin, causal[None], use_cache=False)[0]  # [query, keys by score]
            scores = ours.forward_with_scores(x.transpose(0, 1), qr.transpose(0, 1), mask=causal)[0][0]
        ranked = scores.gather(-1, order)
        drops = [ranked[q, : q + 1].diff() for q in range(1, SEQ)]  # valid (causal) keys come first
        worst_rise = max(d.max().item() for d in drops)
        spread = max((ranked[q, : q + 1].max() - ranked[q, : q + 1].min()).item() for q in range(1, SEQ))
        assert worst_rise <= 0.02 * spread, f"layer {number}: the engine's indexer orders keys differently"
