"""Each runtime patch: a test shows the problem against verl 0.9.1 / megatron-core 0.18.0 without
the patch, then the fix with it. Patches go through the process's real layer (load())."""

from __future__ import annotations

import importlib

import pytest
import torch
from support.runtime_patching import applied, count_dense_index_scores, dsa_config, without

from verl_npu import megatron_adaptor
from verl_npu.ops.hadamard import hadamard_matrix, hadamard_transform
from verl_npu.patching import APPLIED, SKIPPED
from verl_npu.runtime_patches import (
    dsa_call_context,
    dsa_indexer_rotation,
    dsa_local_spec,
    mbridge_instance_mapping,
    ray_runtime_env,
    rope_cpu_init,
)

# --- Ray runtime env -----------------------------------------------------------------------------


def test_verl_drops_the_layer_from_the_ray_runtime_env_and_the_patch_forwards_it(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "verl_npu.megatron_adaptor")
    monkeypatch.setenv("HCCL_DETERMINISTIC", "true")
    monkeypatch.setenv("CLOSE_MATMUL_K_SHIFT", "1")
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    constants = importlib.import_module("verl.trainer.constants_ppo")
    with without(ray_runtime_env.PATCH):
        upstream = constants.get_ppo_ray_runtime_env()["env_vars"]
    assert "VERL_USE_EXTERNAL_MODULES" not in upstream and "HCCL_DETERMINISTIC" not in upstream

    applied(ray_runtime_env.PATCH)
    env_vars = constants.get_ppo_ray_runtime_env()["env_vars"]
    assert env_vars["VERL_USE_EXTERNAL_MODULES"] == "verl_npu.megatron_adaptor"
    assert env_vars["HCCL_DETERMINISTIC"] == "true" and env_vars["CLOSE_MATMUL_K_SHIFT"] == "1"
    assert "HCCL_BUFFSIZE" not in env_vars, "unset variables must not be forwarded"
    for key, value in upstream.items():  # verl's own entries are kept
        assert env_vars[key] == value
    main_ppo = importlib.import_module("verl.trainer.main_ppo")
    if hasattr(main_ppo, "get_ppo_ray_runtime_env"):
        assert main_ppo.get_ppo_ray_runtime_env is constants.get_ppo_ray_runtime_env


def test_the_patch_forwards_every_variable_of_the_cluster_env_file(monkeypatch, tmp_path):
    env_file = tmp_path / "cluster.env"
    env_file.write_text('# one env file: head, workers, driver\nexport MODEL_PATH="/models/x"\nTASK_QUEUE=q1\n')
    monkeypatch.setenv("VERL_NPU_ENV_FILE", str(env_file))
    monkeypatch.setenv("TASK_QUEUE", "q2")  # the launching shell's value wins over the file's literal
    constants = importlib.import_module("verl.trainer.constants_ppo")
    applied(ray_runtime_env.PATCH)
    env_vars = constants.get_ppo_ray_runtime_env()["env_vars"]
    assert env_vars["MODEL_PATH"] == "/models/x" and env_vars["TASK_QUEUE"] == "q2"
    assert env_vars["VERL_NPU_ENV_FILE"] == str(env_file)
    env_file.write_text("MODEL PATH=/x\n")
    with pytest.raises(ValueError, match=r"cluster.env:1: expected NAME=VALUE"):
        constants.get_ppo_ray_runtime_env()


def test_the_interface_variables_are_not_forwarded_from_the_driver(monkeypatch, tmp_path):
    """Interface names differ between nodes: each node's ray_start.sh exports its own before
    `ray start` and the workers inherit them from their raylet, so neither the driver's shell nor
    the env file may override them (the node-local set of ray_runtime_env)."""
    env_file = tmp_path / "cluster.env"
    env_file.write_text("HCCL_SOCKET_IFNAME==eth0\nGLOO_SOCKET_IFNAME=eth0\nHCCL_IF_IP=10.0.0.1\nMODEL_PATH=/m\n")
    monkeypatch.setenv("VERL_NPU_ENV_FILE", str(env_file))
    monkeypatch.setenv("HCCL_SOCKET_IFNAME", "=enp189s0f0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "enp189s0f0")
    monkeypatch.setenv("TP_SOCKET_IFNAME", "enp189s0f0")
    monkeypatch.setenv("HCCL_IF_BASE_PORT", "61000")  # one value for the whole cluster: forwarded
    constants = importlib.import_module("verl.trainer.constants_ppo")
    applied(ray_runtime_env.PATCH)
    env_vars = constants.get_ppo_ray_runtime_env()["env_vars"]
    for name in ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_IF_IP"):
        assert name not in env_vars, name
    assert env_vars["MODEL_PATH"] == "/m" and env_vars["HCCL_IF_BASE_PORT"] == "61000"


# --- Hadamard ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 8, 64, 128])
def test_hadamard_is_exact_against_the_explicit_matrix_in_fp32(size):
    gen = torch.Generator().manual_seed(size)
    integers = torch.randint(-8, 9, (3, 5, size), generator=gen).to(torch.float32)
    reference = integers @ hadamard_matrix(size).T
    assert torch.equal(hadamard_transform(integers), reference)  # integer inputs: bit-exact
    x = torch.randn(4, size, generator=gen)
    scale = size**-0.5
    torch.testing.assert_close(
        hadamard_transform(x, scale), (x @ hadamard_matrix(size).T) * scale, rtol=1e-6, atol=1e-6
    )


def test_hadamard_bf16_within_bf16_tolerance_and_shape_dtype_contract():
    x = torch.randn(2, 7, 128)
    out = hadamard_transform(x.to(torch.bfloat16), 128**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    reference = (x.to(torch.bfloat16).float() @ hadamard_matrix(128).T) * 128**-0.5
    torch.testing.assert_close(out.float(), reference, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dim", [3, 100, 129])
def test_hadamard_pads_non_powers_of_two_and_truncates(dim):
    x = torch.randn(5, dim)
    size = 1 << (dim - 1).bit_length()
    padded = torch.nn.functional.pad(x, (0, size - dim))
    torch.testing.assert_close(hadamard_transform(x), (padded @ hadamard_matrix(size).T)[:, :dim])


def test_hadamard_gradient_is_the_transposed_transform():
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 64)
    hadamard_transform(x, 0.125).backward(g)
    torch.testing.assert_close(x.grad, (g @ hadamard_matrix(64)) * 0.125)


def test_dsa_rotation_fails_without_fast_hadamard_transform_and_the_fallback_matches():
    dsa = importlib.import_module(dsa_indexer_rotation.DSA_MODULE)
    assert dsa.hadamard_transform is None, "this test needs a machine without fast_hadamard_transform"
    x = torch.randn(2, 3, 4, 128).to(torch.bfloat16)
    with without(dsa_indexer_rotation.PATCH), pytest.raises(AssertionError, match="fast_hadamard_transform"):
        dsa.rotate_activation(x)
    applied(dsa_indexer_rotation.PATCH)
    out = dsa.rotate_activation(x)
    reference = (x.float() @ hadamard_matrix(128).T) * 128**-0.5
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), reference, rtol=1.6e-2, atol=1e-2)
    with pytest.raises(AssertionError, match="only support bf16"):
        dsa.rotate_activation(x.float())


def test_the_extension_rotates_where_installed_and_a_glm5_indexshare_layer_does_not_rotate(monkeypatch):
    from verl_npu.engine import index_share

    dsa = importlib.import_module(dsa_indexer_rotation.DSA_MODULE)
    x = torch.randn(2, 128).to(torch.bfloat16)
    extension = []
    monkeypatch.setattr(dsa, "hadamard_transform", lambda t, scale: extension.append(scale) or t * 2)  # stand-in
    rotate = dsa_indexer_rotation.PATCH.build(lambda t: dsa.hadamard_transform(t, t.size(-1) ** -0.5))
    torch.testing.assert_close(rotate(x), x * 2)
    assert extension == [128**-0.5]
    with index_share._source_scope(layer_number=3, rotate=False):  # what a GLM-5 full layer's forward sets
        assert rotate(x) is x
    assert extension == [128**-0.5]


# --- DSA on the local spec, with CPU initialisation ------------------------------------------------


@pytest.fixture(scope="module")
def model_parallel_cpu():
    """torch.distributed (gloo, world size 1) and megatron's model-parallel groups, without the CUDA harness."""
    from verl_npu.testing import cpu_megatron

    cpu_megatron.init_model_parallel()


def build_dsa_attention():
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module

    config = dsa_config()
    spec = get_dsa_module_spec_for_backend(config, backend=LocalSpecProvider())
    return build_module(spec, config=config, layer_number=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU-only failure; a CUDA machine builds anyway")
def test_dsa_does_not_build_on_the_local_spec_or_cpu_upstream_and_builds_with_the_patches(model_parallel_cpu):
    local = (*dsa_local_spec.PATCHES,)
    with without(*local), pytest.raises(AttributeError, match="'LocalSpecProvider' object has no attribute 'linear'"):
        build_dsa_attention()
    with without(dsa_local_spec.MLA_LINEAR), pytest.raises(ValueError, match="Unsupported linear_q_down_proj"):
        build_dsa_attention()
    with without(*rope_cpu_init.PATCHES), pytest.raises(RuntimeError, match=r"NVIDIA driver|CUDA"):
        build_dsa_attention()

    attention = build_dsa_attention()
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    indexer = next(m for m in attention.modules() if isinstance(m, DSAIndexer))
    assert isinstance(indexer.linear_wq_b, dsa_local_spec.DuplicatedLinear)
    assert isinstance(attention.linear_q_down_proj, dsa_local_spec.DuplicatedLinear)
    assert attention.rotary_pos_emb.inv_freq.device.type == "cpu"
    assert indexer.rotary_pos_emb.inv_freq.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in attention.parameters())


def test_duplicated_linear_matches_torch_linear_and_marks_its_parameters():
    config = dsa_config()
    layer = dsa_local_spec.DuplicatedLinear(
        16, 8, config=config, init_method=torch.nn.init.normal_, bias=True, skip_bias_add=True
    )
    x = torch.randn(3, 2, 16)
    out, bias = layer(x)
    torch.testing.assert_close(out, x @ layer.weight.T)
    assert bias is layer.bias
    assert all(p.sequence_parallel is config.sequence_parallel for p in layer.parameters())
    with pytest.raises(ValueError, match="only supports parallel_mode='duplicated', got 'column'"):
        dsa_local_spec.DuplicatedLinear(16, 8, config=config, init_method=torch.nn.init.normal_, parallel_mode="column")


def test_every_patch_of_the_registry_reaches_a_final_status_here():
    layer = megatron_adaptor.load()
    layer.import_patch_targets()
    statuses = {r.id: r.status for r in layer.records()}
    assert set(statuses) == {p.id for p in __import__("verl_npu.runtime_patches").runtime_patches.ALL}
    assert set(statuses.values()) <= {APPLIED, SKIPPED}


# --- DSA sparse attention --------------------------------------------------------------------------


def test_dsa_attention_is_replaced_by_the_sparse_one_with_the_same_result():
    from megatron.core.transformer.experimental_attention_variant import dsa

    from verl_npu.runtime_patches import dsa_sparse_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 2, 4, 16, generator=gen, dtype=torch.float32) for _ in range(3))
    idx = torch.randint(0, 24, (2, 24, 6), generator=gen).minimum(torch.arange(24).view(1, 24, 1))
    with without(dsa_sparse_attention.PATCH):
        dense = dsa.unfused_dsa_fn(q, k, v, idx, 0.25)
    applied(dsa_sparse_attention.PATCH)
    assert dsa.unfused_dsa_fn.__module__ == "verl_npu.runtime_patches.dsa_sparse_attention"
    torch.testing.assert_close(dsa.unfused_dsa_fn(q, k, v, idx, 0.25), dense, atol=1e-5, rtol=1e-5)


def test_the_indexer_loss_is_skipped_exactly_when_its_coefficient_is_zero(monkeypatch):
    import types

    from megatron.core.transformer.experimental_attention_variant import dsa

    from verl_npu.runtime_patches import dsa_indexer_without_loss

    gen = torch.Generator().manual_seed(1)
    s, b, heads, dim = 20, 2, 4, 16
    q, k = torch.randn(s, b, heads, dim, generator=gen), torch.randn(s, b, dim, generator=gen)
    weights = torch.rand(s, b, heads, generator=gen)
    query, key = torch.randn(s, b, 3, 8, generator=gen), torch.randn(s, b, 3, 8, generator=gen)
    mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
    group = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    args = (q, weights, k, query, key, 6, 0.3)
    with without(*dsa_indexer_without_loss.PATCHES):
        ref_idx, ref_loss = dsa.fwd_fused_indexer_loss_naive(*args, 0.0, mask, False, group)
        ref_grads = dsa.bwd_fused_indexer_loss_naive(q, weights, k, query, key, ref_idx, 0.3, 0.0, False,
                                                      torch.tensor(1.0), group)  # fmt: skip
        with_loss = dsa.fwd_fused_indexer_loss_naive(*args, 0.5, mask, False, group)
    for patch in dsa_indexer_without_loss.PATCHES:
        applied(patch)
    # outside DSAttention a 2-D mask might be a b=1 padding mask: megatron's code, dense scores and all
    dense = count_dense_index_scores(monkeypatch)
    outside, _ = dsa.fwd_fused_indexer_loss_naive(*args, 0.0, mask, False, group)
    assert dense == [1] and torch.equal(outside, ref_idx)
    with dsa_call_context.dsa_attention_call(causal=True):  # what DSAttention's causal forward records
        idx, loss = dsa.fwd_fused_indexer_loss_naive(*args, 0.0, mask, False, group)
    assert dense == [1]
    scores = dsa._compute_index_scores(q, weights, k) + mask
    for bb in range(b):  # the same keys by score (ties aside), and a zero loss
        torch.testing.assert_close(scores[bb].gather(-1, idx[bb]).sort(-1).values,
                                   scores[bb].gather(-1, ref_idx[bb]).sort(-1).values)  # fmt: skip
    assert loss.item() == ref_loss.item() == 0.0
    grads = dsa.bwd_fused_indexer_loss_naive(q, weights, k, query, key, idx, 0.3, 0.0, False, torch.tensor(1.0), group)
    for mine, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(mine, torch.zeros_like(ref)) and torch.equal(ref, torch.zeros_like(ref))
    again = dsa.fwd_fused_indexer_loss_naive(*args, 0.5, mask, False, group)  # a real loss: megatron's code
    assert torch.equal(again[0], with_loss[0]) and again[1].item() == with_loss[1].item() > 0


# --- the registry --------------------------------------------------------------------------------


def test_every_patch_module_exports_a_patches_tuple_and_the_registry_is_exactly_theirs():
    import pkgutil

    from verl_npu import runtime_patches
    from verl_npu.runtime_patches import _targets

    names = {m.name for m in pkgutil.iter_modules(runtime_patches.__path__) if not m.name.startswith("_")}
    assert {m.__name__.rsplit(".", 1)[1] for m in runtime_patches.MODULES} == names, "a patch module is not registered"
    for module in runtime_patches.MODULES:
        assert isinstance(module.PATCHES, tuple) and module.PATCHES, module.__name__
    assert tuple(p for m in runtime_patches.MODULES for p in m.PATCHES) == runtime_patches.ALL
    assert len({p.id for p in runtime_patches.ALL}) == len(runtime_patches.ALL)
    # the shared facts are the ones the declarations use
    megatron = [p for p in runtime_patches.ALL if "megatron-core" in p.requires]
    assert megatron and all(p.requires["megatron-core"] == _targets.MEGATRON_CORE["megatron-core"] for p in megatron)


def test_the_megatron_core_gate_is_the_pinned_release():
    from verl_npu.runtime_patches._targets import MEGATRON_CORE
    from verl_npu.stack import load_stack

    assert MEGATRON_CORE["megatron-core"] == "==" + load_stack().expected_versions("dev")["megatron-core"]


# --- mbridge's name table per bridge --------------------------------------------------------------------------


def qwen2_output_layer_source(tie: bool) -> list[str]:
    """The HF tensor a new Qwen2 bridge maps megatron's output layer to (mbridge's own mapping code)."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen2 import Qwen2Bridge
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)  # fmt: skip
    bridge = Qwen2Bridge(config, parallel_states=ParallelStates())
    return bridge._weight_name_mapping_mcore_to_hf("output_layer.weight")


def test_a_tied_qwen2_bridge_ties_every_later_one_upstream_and_only_itself_with_the_patch():
    from mbridge.models.qwen2 import Qwen2Bridge

    table = Qwen2Bridge._DIRECT_MAPPING
    before = dict(table)
    try:
        with without(mbridge_instance_mapping.PATCH):
            assert qwen2_output_layer_source(tie=True) == ["model.embed_tokens.weight"]
            # mbridge 0.15.1: the tied bridge wrote into the class's table; an untied critic now loads its head from
            # the embedding
            assert qwen2_output_layer_source(tie=False) == ["model.embed_tokens.weight"]
        table.clear()
        table.update(before)

        assert qwen2_output_layer_source(tie=True) == ["model.embed_tokens.weight"]
        assert qwen2_output_layer_source(tie=False) == ["lm_head.weight"]
        assert before == Qwen2Bridge._DIRECT_MAPPING  # the class table untouched
    finally:
        table.clear()
        table.update(before)
