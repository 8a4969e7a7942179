"""Engine pieces on a real accelerator: a tiny GLM-5-shaped model (MLA + DSA + MoE) with fused RMSNorm.

Runs on CUDA (the H100 stand-in, through the device tool) or an NPU; skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl_npu.models.glm5.config import glm5_2_indexer_types

pytestmark = pytest.mark.accel


@pytest.fixture(scope="module")
def device():
    os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")  # the stand-in's torch differs from the Ascend pin
    import verl_npu.megatron_adaptor  # noqa: F401  (the runtime patches: Hadamard fallback, DSA local spec)
    from verl_npu.testing.distributed import init_single_process

    init_single_process("nccl", device_index=0)
    return torch.device("cuda", 0)


# GLM-5 (every layer computes its DSA top-k) and GLM-5.2 (IndexShare: layers 3-5 reuse layer 2's top-k)
LAYOUTS = {"glm5": ["full"] * 3, "glm5_2": glm5_2_indexer_types(7)}


def tiny_glm5(seed: int, layout: str = "glm5"):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from transformers import GlmMoeDsaConfig

    from verl_npu.testing.glm5_model import build_glm5_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    kinds = LAYOUTS[layout]
    hf = GlmMoeDsaConfig(
        vocab_size=256, hidden_size=256, num_hidden_layers=len(kinds), num_attention_heads=4, intermediate_size=512,
        moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        mlp_layer_types=["dense", *["sparse"] * (len(kinds) - 1)], q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=16,
        max_position_embeddings=128, indexer_types=kinds,
    )  # fmt: skip
    model = build_glm5_model(hf, fused_rmsnorm=True, params_dtype=torch.bfloat16, bf16=True)
    model = Float16Module(model.config, model.cuda())
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True, params_dtype=torch.bfloat16
        ),
        [ddp],
    )
    return ddp, optimizer


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (2, 64), generator=gen).cuda()
    return tokens, torch.arange(64, device="cuda").unsqueeze(0).expand(2, -1)


def train_step(ddp, optimizer, step: int) -> float:
    from verl_npu.testing.cpu_megatron import run_step  # the step itself is device-neutral

    return run_step(ddp, optimizer, *batch(step))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_five_steps_with_full_offload_cycles_equal_the_no_offload_run(device, layout):
    from verl_npu.engine.modules import RMSNorm
    from verl_npu.engine.offload import OffloadManager

    ddp, optimizer = tiny_glm5(3, layout)
    assert any(isinstance(m, RMSNorm) for m in ddp.modules()), "fused RMSNorm was not wired in"
    indexed = {int(n.split("layers.")[1].split(".")[0]) for n, _ in ddp.named_parameters() if ".indexer." in n}
    assert indexed == {i for i, kind in enumerate(LAYOUTS[layout]) if kind == "full"}  # shared: no indexer bytes
    reference = [train_step(ddp, optimizer, s) for s in range(5)]
    ddp2, optimizer2 = tiny_glm5(3, layout)
    manager = OffloadManager([ddp2], optimizer2, device=device)
    losses = []
    for s in range(5):
        losses.append(train_step(ddp2, optimizer2, s))
        before = torch.cuda.memory_allocated()
        manager.offload()
        assert torch.cuda.memory_allocated() < before
        manager.onload()
    assert losses == reference
    manager.close()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_while_offloaded_then_restore_and_resume_gives_identical_losses(device, layout):
    from verl_npu.engine.offload import OffloadManager, _optimizers

    ddp, optimizer = tiny_glm5(5, layout)
    for s in range(2):
        train_step(ddp, optimizer, s)
    manager = OffloadManager([ddp], optimizer, device=device)
    manager.offload()
    with manager.resident(["params", "optimizer"]):  # save while offloaded
        saved_params = [p.detach().clone() for p in ddp.parameters()]
        saved_state = [
            {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)}
            for inner in _optimizers(optimizer)
            for state in inner.state.values()
        ]
        main_params = [p for inner in _optimizers(optimizer) for g in inner.param_groups for p in g["params"]]
        saved_main = [p.detach().clone() for p in main_params]  # fp32 master weights of the bf16 model
    manager.onload()
    resumed_a = [train_step(ddp, optimizer, s) for s in range(2, 5)]
    for param, saved in zip(ddp.parameters(), saved_params, strict=True):  # restore
        param.data.copy_(saved)
    states = [state for inner in _optimizers(optimizer) for state in inner.state.values()]
    for state, saved in zip(states, saved_state, strict=True):
        for key, value in saved.items():
            state[key].copy_(value)
    for param, saved in zip(main_params, saved_main, strict=True):
        param.data.copy_(saved)
    resumed_b = [train_step(ddp, optimizer, s) for s in range(2, 5)]
    assert resumed_a == resumed_b
    manager.close()


def test_leak_sentinel_zero_growth_with_detached_outputs_and_growth_without(device):
    from verl_npu.testing.leak_sentinel import measure_growth

    ddp, _optimizer = tiny_glm5(9)
    kept: list[torch.Tensor] = []

    def micro_batch(detach: bool):
        def run(i: int) -> None:
            tokens, positions = batch(i % 4)
            out = ddp(tokens, positions, None, labels=tokens)
            if detach:  # verl's contract: outputs kept across micro-batches are detached
                out.float().mean().backward()
                kept.append(out.detach())
            else:  # an attached output pins its whole autograd graph (activations) until released
                kept.append(out)

        return run

    def unexplained_memory() -> int:
        """Device memory beyond the outputs deliberately kept: what a leak would add to."""
        return torch.cuda.memory_allocated() - sum(t.numel() * t.element_size() for t in kept)

    clean = measure_growth(micro_batch(True), 50, unexplained_memory)
    kept.clear()
    leaking = measure_growth(micro_batch(False), 12, unexplained_memory)
    kept.clear()
    assert clean.growth_per_micro_batch == 0.0 and not clean.leaks, clean
    assert leaking.leaks and leaking.growth_per_micro_batch > 100_000, leaking  # the sentinel does see a leak


def test_no_grad_log_probs_use_the_chunked_indexer_top_k_and_equal_megatrons(device, monkeypatch):
    """Old/ref log-probs (no gradients): DSAttention's eval branch with dsa-indexer-topk-eval equals megatron's own."""
    from support.runtime_patching import count_dense_index_scores, without

    from verl_npu.runtime_patches import dsa_indexer_topk_eval

    ddp, _optimizer = tiny_glm5(11)
    ddp.eval()
    tokens, positions = batch(0)
    with without(*dsa_indexer_topk_eval.PATCHES), torch.no_grad():
        reference = ddp(tokens, positions, None)
    dense_calls = count_dense_index_scores(monkeypatch)
    with torch.no_grad():
        logits = ddp(tokens, positions, None)
    assert dense_calls == []
    torch.testing.assert_close(logits, reference)
