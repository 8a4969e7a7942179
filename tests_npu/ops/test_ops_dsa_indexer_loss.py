"""The chunked DSA indexer KL loss against megatron-core 0.18's fused naive forward and backward."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl_npu.ops import dispatch
from verl_npu.ops.dsa_indexer_loss import indexer_kl_loss, indexer_kl_loss_grads, indexer_kl_loss_value

NO_TP = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


def inputs(sq, b, heads, dim, attn_heads, head_dim, dtype, seed, key_heads=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, dim, generator=gen)
    k = torch.randn(sq, b, dim, generator=gen)
    weights = torch.rand(sq, b, heads, generator=gen)
    query = torch.randn(sq, b, attn_heads, head_dim, generator=gen)
    key = torch.randn(sq, b, key_heads or attn_heads, head_dim, generator=gen)
    return tuple(t.to(dtype) for t in (q, weights, k, query, key))


def megatron(q, weights, k, query, key, topk, scale, coeff, sparse, grad_loss):
    """megatron's (topk_indices, loss, (dq, dweights, dk)) under DSAttention's causal mask."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    sq = q.shape[0]
    mask = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    idx, loss = dsa.fwd_fused_indexer_loss_naive(q, weights, k, query, key, topk, scale, coeff, mask, sparse, NO_TP)
    grads = dsa.bwd_fused_indexer_loss_naive(
        q, weights, k, query, key, idx, scale, coeff, sparse, torch.tensor(grad_loss), NO_TP
    )
    return idx, loss, grads


def assert_grads_close(mine, ref, dtype):
    for name, a, r in zip(("dq", "dweights", "dk"), mine, ref, strict=True):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        scale = r.float().abs().max().clamp(min=1e-12)
        # fp32: summation order only; bf16: both round the same fp32 gradient, at most one ulp apart
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(a.float() / scale, r.float() / scale, atol=tol, rtol=tol, msg=name)


CASES = [  # sq, b, indexer heads, indexer dim, attention heads, head dim, topk, chunk budget
    (13, 2, 5, 12, 3, 10, 4, 2**26),  # odd sizes, one chunk
    (9, 1, 2, 8, 2, 6, 20, 50),  # topk > s, one row per chunk
    (17, 2, 3, 8, 4, 8, 5, 7 * 17 * 2 * 3),  # several rows per chunk, a ragged last chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize(("sq", "b", "heads", "dim", "attn_heads", "head_dim", "topk", "budget"), CASES)
def test_loss_and_gradients_match_megatrons(dtype, sparse, sq, b, heads, dim, attn_heads, head_dim, topk, budget):
    q, weights, k, query, key = inputs(sq, b, heads, dim, attn_heads, head_dim, dtype, seed=sq)
    idx, ref_loss, ref_grads = megatron(q, weights, k, query, key, topk, 0.3, 0.7, sparse, grad_loss=1.5)
    assert ref_loss.item() > 0.01, "a loss this small could not tell a wrong implementation apart"

    leaves = [t.clone().requires_grad_() for t in (q, weights, k)]
    loss = indexer_kl_loss(*leaves, query, key, idx, 0.3, 0.7, sparse, chunk_budget_elements=budget)
    (loss * 1.5).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close([t.grad for t in leaves], ref_grads, dtype)
    # the functional halves (what a fused autograd Function calls) are the same numbers
    torch.testing.assert_close(indexer_kl_loss_value(q, weights, k, query, key, idx, 0.3, 0.7, sparse), loss)
    grads = indexer_kl_loss_grads(q, weights, k, query, key, idx, 0.3, 0.7, sparse, torch.tensor(1.5))
    assert_grads_close(grads, ref_grads, dtype)


def test_the_sparse_variant_ignores_unselected_keys_and_the_dense_one_does_not():
    q, weights, k, query, key = inputs(12, 1, 2, 8, 2, 8, torch.float32, seed=3)
    idx = torch.arange(12).view(1, 12, 1).expand(1, 12, 3).clone()  # every row selects only itself
    # with only the query itself selected both softmaxes are one-hot: the sparse loss is exactly 0
    assert indexer_kl_loss_value(q, weights, k, query, key, idx, 0.3, 1.0, True).item() == pytest.approx(0.0, abs=1e-6)
    assert indexer_kl_loss_value(q, weights, k, query, key, idx, 0.3, 1.0, False).item() > 0.01
    # out-of-range entries and duplicates select nothing more
    noisy = torch.cat((idx, torch.full((1, 12, 2), 12), torch.full((1, 12, 1), -1)), dim=-1)
    assert indexer_kl_loss_value(q, weights, k, query, key, noisy, 0.3, 1.0, True).item() == pytest.approx(
        0.0, abs=1e-6
    )


def test_one_key_head_shared_by_all_query_heads_equals_the_expanded_key():
    q, weights, k, query, key = inputs(11, 2, 3, 8, 4, 6, torch.float32, seed=5, key_heads=1)
    # each row keeps a causal key (a row without one has no target: NaN, in megatron's loss as well)
    idx = torch.randint(0, 11, (2, 11, 4), generator=torch.Generator().manual_seed(0)).minimum(
        torch.arange(11)[:, None]
    )
    for sparse in (False, True):
        shared = [t.clone().requires_grad_() for t in (q, weights, k)]
        expanded = [t.clone().requires_grad_() for t in (q, weights, k)]
        a = indexer_kl_loss(*shared, query, key, idx, 0.4, 1.0, sparse, chunk_budget_elements=100)
        r = indexer_kl_loss(*expanded, query, key.expand(-1, -1, 4, -1), idx, 0.4, 1.0, sparse)
        a.backward()
        r.backward()
        torch.testing.assert_close(a, r)
        for x, y in zip(shared, expanded, strict=True):
            torch.testing.assert_close(x.grad, y.grad)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward run in this thread on CPU)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_memory_is_one_chunk_of_scores_never_an_s_by_s_tensor():
    s, b, heads, dim, attn_heads, head_dim = 64, 1, 2, 8, 4, 8
    q, weights, k, query, key = inputs(s, b, heads, dim, attn_heads, head_dim, torch.float32, seed=7)
    idx = torch.randint(0, s, (b, s, 8), generator=torch.Generator().manual_seed(1))
    dense = b * heads * s * s  # the smaller of megatron's two dense buffers ([s, b, h, s] index scores)
    with LargestTensor() as theirs:
        megatron(q, weights, k, query, key, 8, 0.3, 1.0, True, grad_loss=1.0)
    assert theirs.numel >= b * attn_heads * s * s  # the probe sees megatron's [b, np, s, s] scores

    leaves = [t.clone().requires_grad_() for t in (q, weights, k)]
    budget = 2 * b * (attn_heads + heads) * s  # two query rows per chunk
    with LargestTensor() as ours:
        indexer_kl_loss(*leaves, query, key, idx, 0.3, 1.0, True, chunk_budget_elements=budget).backward()
    # largest: the fp32 key copy [b, np, hn, s] and the inputs, O(s); a chunk's scores are 2 * np * s
    assert ours.numel <= max(t.numel() for t in (q, weights, k, query, key)) < dense // 2


def test_shape_mismatches_are_refused_with_the_expected_layout():
    q, weights, k, query, key = inputs(6, 2, 3, 8, 4, 6, torch.float32, seed=0)
    idx = torch.zeros(2, 6, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"indexer k \(6, 2, 7\).*expected k \[sk, b=2, d=8\]"):
        indexer_kl_loss(q, weights, torch.randn(6, 2, 7), query, key, idx, 0.3, 1.0)
    with pytest.raises(ValueError, match=r"key \(6, 2, 3, 6\): expected \[sk=6, b=2, 4 or 1 heads, dim\]"):
        indexer_kl_loss(q, weights, k, query, key[:, :, :3], idx, 0.3, 1.0)
    with pytest.raises(ValueError, match=r"topk_indices \(2, 5, 2\): expected \[b=2, sq=6, topk\]"):
        indexer_kl_loss(q, weights, k, query, key, idx[:, :5], 0.3, 1.0)


def test_the_dispatcher_runs_the_portable_loss_on_cpu():
    q, weights, k, query, key = inputs(10, 2, 3, 8, 2, 6, torch.float32, seed=2)
    idx = torch.randint(0, 10, (2, 10, 3), generator=torch.Generator().manual_seed(2)).minimum(
        torch.arange(10)[:, None]
    )
    assert dispatch.backend_for("dsa_indexer_loss", q.device) == "portable"
    torch.testing.assert_close(
        dispatch.dsa_indexer_loss(q, weights, k, query, key, idx, 0.3, 0.5, True),
        indexer_kl_loss(q, weights, k, query, key, idx, 0.3, 0.5, True),
    )


TENSOR_PARALLEL = textwrap.dedent(
    """
    import os, sys, types
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from megatron.core.transformer.experimental_attention_variant import dsa
        from verl_npu.ops.dsa_indexer_loss import indexer_kl_loss
        gen = torch.Generator().manual_seed(0)
        s, b = 14, 2
        q, k = torch.randn(s, b, 3, 8, generator=gen), torch.randn(s, b, 8, generator=gen)
        w = torch.rand(s, b, 3, generator=gen)
        query, key = torch.randn(s, b, 4, 6, generator=gen), torch.randn(s, b, 4, 6, generator=gen)
        heads = slice(2 * rank, 2 * rank + 2)  # TP=2 splits the 4 attention heads; the indexer is duplicated
        tp = types.SimpleNamespace(tp=dist.group.WORLD)
        mask = torch.triu(torch.full((s, s), float("-inf")), diagonal=1)
        for sparse in (False, True):
            idx, ref = dsa.fwd_fused_indexer_loss_naive(q, w, k, query[:, :, heads], key[:, :, heads], 5, 0.3, 0.7,
                                                        mask, sparse, tp)
            ref_grads = dsa.bwd_fused_indexer_loss_naive(q, w, k, query[:, :, heads], key[:, :, heads], idx, 0.3, 0.7,
                                                         sparse, torch.tensor(1.0), tp)
            leaves = [t.clone().requires_grad_() for t in (q, w, k)]
            loss = indexer_kl_loss(*leaves, query[:, :, heads], key[:, :, heads], idx, 0.3, 0.7, sparse,
                                   tp_group=dist.group.WORLD, chunk_budget_elements=3 * 6 * 14)
            loss.backward()
            torch.testing.assert_close(loss, ref)
            for mine, theirs in zip((t.grad for t in leaves), ref_grads):
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
            # the head-split loss is the one of all heads on one device
            torch.testing.assert_close(loss, indexer_kl_loss(q, w, k, query, key, idx, 0.3, 0.7, sparse))
        print(f"ok {rank}", flush=True)

    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=2, join=True)
    """
)


def test_tensor_parallel_heads_are_all_reduced_as_megatron_does(tmp_path):
    import socket

    script = tmp_path / "tp2.py"
    script.write_text(TENSOR_PARALLEL)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(re.findall(r"ok \d", done.stdout)) == ["ok 0", "ok 1"]  # the ranks' lines may interleave


# --- the runtime patch: megatron's DSA attention with the indexer loss trained -------------------


@pytest.fixture(scope="module")
def model_parallel_cpu():
    from verl_npu.testing import cpu_megatron

    cpu_megatron.init_model_parallel()


def build_trained_dsa_attention(sparse_loss: bool):
    """megatron's MLA self-attention with a DSA core, bf16 (the indexer's rotation takes bf16 only), loss on."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module
    from support.runtime_patching import dsa_config

    config = dataclasses.replace(
        dsa_config(), params_dtype=torch.bfloat16, bf16=True, dsa_indexer_loss_coeff=0.25,
        dsa_indexer_use_sparse_loss=sparse_loss, dsa_indexer_topk=5,
    )  # fmt: skip
    spec = get_dsa_module_spec_for_backend(config, backend=LocalSpecProvider())
    torch.manual_seed(0)
    attention = build_module(spec, config=config, layer_number=1)
    with torch.no_grad():  # wider than the init's 0.02: distributions far from uniform, a loss far from 0
        for param in attention.parameters():
            param.normal_(0.0, 0.3)
    return attention.train()


@pytest.mark.parametrize("sparse_loss", [False, True])
def test_megatrons_dsa_attention_gives_the_same_loss_and_gradients_with_the_patch(
    model_parallel_cpu, monkeypatch, sparse_loss
):
    from megatron.core.transformer.experimental_attention_variant import dsa
    from support.runtime_patching import applied, without

    from verl_npu.runtime_patches import dsa_indexer_loss

    # the loss tracker allocates on torch.cuda.current_device(); the CPU stands in for the device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(dsa.DSAIndexerLossLoggingHelper, "tracker", {})
    attention = build_trained_dsa_attention(sparse_loss)
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def step():
        attention.zero_grad(set_to_none=True)
        dsa.DSAIndexerLossLoggingHelper.tracker.clear()
        out, _ = attention(x, None)
        out.float().square().sum().backward()
        grads = {name: p.grad.clone() for name, p in attention.named_parameters() if p.grad is not None}
        return out.detach(), dsa.DSAIndexerLossLoggingHelper.tracker["values"].clone(), grads

    with without(dsa_indexer_loss.PATCH):
        ref_out, ref_loss, ref_grads = step()
    applied(dsa_indexer_loss.PATCH)
    assert dsa.FusedDSAIndexerLoss.__module__ == "verl_npu.runtime_patches.dsa_indexer_loss"
    out, loss, grads = step()

    assert ref_loss.item() > 0.01
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)  # the logged indexer loss
    torch.testing.assert_close(out, ref_out)  # the same top-k keys, so the same attention
    indexer = [name for name in ref_grads if ".indexer." in name]
    assert len(indexer) >= 4 and set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        # bf16 parameters: the loss's fp32 gradients agree to rounding, then go through bf16 matmuls
        scale = ref.float().abs().max()
        torch.testing.assert_close(grads[name].float() / scale, ref.float() / scale, atol=2e-2, rtol=0, msg=name)
        assert scale > 0, name


def test_the_patch_leaves_coefficient_zero_and_padding_masks_to_megatrons_class():
    from megatron.core.transformer.experimental_attention_variant import dsa

    from verl_npu.runtime_patches import dsa_call_context, dsa_indexer_loss

    calls = []

    class Megatrons:
        @staticmethod
        def apply(*args):
            calls.append(args[7:9])
            return "megatron"

    patched = dsa_indexer_loss.PATCH.build(Megatrons)
    q, weights, k, query, key = inputs(8, 1, 2, 8, 2, 8, torch.float32, seed=4)
    causal = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
    padding = torch.zeros(1, 8, 8)
    assert patched.apply(q, weights, k, query, key, 0.3, 4, 0.0, causal, False, NO_TP) == "megatron"
    assert patched.apply(q, weights, k, query, key, 0.3, 4, 0.5, padding, False, NO_TP) == "megatron"
    # outside DSAttention, or inside it with a non-causal mask type, a 2-D mask may be a b=1 padding mask
    assert patched.apply(q, weights, k, query, key, 0.3, 4, 0.5, causal, False, NO_TP) == "megatron"
    with dsa_call_context.dsa_attention_call(causal=False):
        assert patched.apply(q, weights, k, query, key, 0.3, 4, 0.5, causal, False, NO_TP) == "megatron"
    assert len(calls) == 4
    with dsa_call_context.dsa_attention_call(causal=True):
        idx, loss = patched.apply(q, weights, k, query, key, 0.3, 4, 0.5, causal, True, NO_TP)
    assert len(calls) == 4 and idx.shape == (1, 8, 4)
    torch.testing.assert_close(loss, megatron(q, weights, k, query, key, 4, 0.3, 0.5, True, 1.0)[1])
    assert issubclass(dsa_indexer_loss.PATCH.build(dsa.FusedDSAIndexerLoss), torch.autograd.Function)
