"""IndexShare (GLM-5.2's shared DSA top-k) in the engine, on a tiny GLM-5.2-shaped model on the CPU harness.

Layers 0, 1, 2 and 6 are full and 3, 4, 5 and 7 shared, GLM-5.2's rule (full for i < 3 or
(i - 2) % 4 == 0) on 8 layers; the index top-k (6) is smaller than the sequences (24 tokens), so the
selection matters. fp32, so that recomputation and no-grad paths can be compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from support.index_share_model import HF, KINDS, SEQ

import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches)
from verl_npu.engine import index_share
from verl_npu.testing.glm5_model import build_glm5_model

pytestmark = pytest.mark.usefixtures("cpu_megatron_harness")


def model(seed: int = 1, **overrides):
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    fields = dict(use_cpu_initialization=True, params_dtype=torch.float32, moe_token_dispatcher_type="allgather")
    return build_glm5_model(HF, fused_rmsnorm=False, **(fields | overrides))


def batch(seed: int, b: int = 2):
    tokens = torch.randint(0, HF.vocab_size, (b, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(b, -1)


def loss_and_grads(net, tokens, positions):
    net.zero_grad()
    loss = net(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def latest_full(layer: int) -> int:
    """The layer number (1-based) whose top-k layer number ``layer`` reuses under IndexShare."""
    return max(i + 1 for i in range(layer) if KINDS[i] == "full")


def test_shared_layers_build_no_indexer_and_full_layers_use_the_reference_key_norm():
    net = model()
    source, shared, _ = index_share.classes()
    for i, layer in enumerate(net.decoder.layers):
        attention = layer.self_attention.core_attention
        names = [n for n, _ in layer.named_parameters() if ".indexer." in n]
        if KINDS[i] == "full":
            assert type(attention) is source and names, i
            assert attention.indexer.k_norm.eps == index_share.REFERENCE_K_NORM_EPS != net.config.layernorm_epsilon
        else:
            assert type(attention) is shared and names == [], (i, names)
    full_params = sum(p.numel() for n, p in net.named_parameters() if ".indexer." in n)
    per_layer = sum(p.numel() for n, p in net.decoder.layers[0].named_parameters() if ".indexer." in n)
    assert full_params == KINDS.count("full") * per_layer  # shared layers: no parameters, so no DDP/optimizer bytes


def test_each_shared_layer_attends_over_the_most_recent_full_layers_top_k():
    net = model().eval()
    tokens, positions = batch(0)
    with torch.no_grad(), index_share.record_topk() as trace:
        net(tokens, positions, None)
    assert sorted(trace) == list(range(1, 9))
    for number, (kind, topk) in trace.items():
        assert kind == KINDS[number - 1], number
        assert topk.shape == (2, SEQ, HF.index_topk)
        if kind == "shared":
            assert torch.equal(topk, trace[latest_full(number)][1]), number
    # different full layers select different keys: a shared layer's own top-k would differ too
    assert not torch.equal(trace[1][1], trace[7][1])


def test_no_top_k_survives_its_forward_pass():
    net = model().eval()
    (first, positions), (second, _) = batch(1), batch(2)
    with torch.no_grad():
        net(first, positions, None)
        assert index_share._CARRY.get() is None
        with index_share.record_topk() as trace:
            net(second, positions, None)
    with torch.no_grad(), index_share.record_topk() as alone:
        net(second, positions, None)  # the second batch on its own gives the same selection
    for number in trace:
        assert torch.equal(trace[number][1], alone[number][1]), number


def test_a_forward_without_its_scope_fails_instead_of_guessing():
    from support.runtime_patching import without

    from verl_npu.runtime_patches import dsa_index_share

    net = model().eval()
    forward_scope = next(p for p in dsa_index_share.PATCHES if p.id == "dsa-index-share-forward")
    with without(forward_scope), torch.no_grad(), pytest.raises(index_share.IndexShareError, match="has none"):
        net(*batch(3), None)


@pytest.mark.parametrize("chunk", [1, 3])
def test_full_recompute_gives_the_same_loss_and_gradients(chunk):
    """Chunks of 1 or 3 layers: several start on a shared layer, whose top-k comes from an earlier chunk."""
    reference = model()
    recomputed = model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=chunk)
    recomputed.load_state_dict(reference.state_dict())
    tokens, positions = batch(4)
    ref_loss, ref_grads = loss_and_grads(reference, tokens, positions)
    loss, grads = loss_and_grads(recomputed, tokens, positions)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def test_selective_recompute_gives_the_same_loss_and_gradients():
    """The modules megatron-core 0.18 recomputes selectively on local (non-TE) layers, but core_attn, whose
    checkpoint drops DSA's inputs in megatron-core 0.18 (the build plan refuses it for DSA, naming these)."""
    reference = model()
    recomputed = model(recompute_granularity="selective", recompute_modules=["mla_up_proj", "mlp", "moe"])
    recomputed.load_state_dict(reference.state_dict())
    tokens, positions = batch(4)
    ref_loss, ref_grads = loss_and_grads(reference, tokens, positions)
    with index_share.record_topk() as trace:
        loss, grads = loss_and_grads(recomputed, tokens, positions)
    assert sorted(trace) == list(range(1, 9))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def test_recomputed_chunks_keep_a_top_k_until_backward_only_when_they_read_it(monkeypatch):
    """One-layer chunks: the chunks of shared layers 4-6 read full layer 3's top-k and layer 8's reads layer 7's;
    full layers' chunks publish their own first, so layers 1 and 2's top-k is not held until backward."""
    import gc
    import weakref

    net = model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    published = {}
    publish = index_share.publish

    def recording_publish(topk_indices):
        source = index_share._SOURCE.get()  # None in a shared layer's sparse attention
        if source is not None and not torch.is_grad_enabled():  # the checkpointed forward, not the recomputation
            published[source.layer_number] = weakref.ref(topk_indices)
        publish(topk_indices)

    monkeypatch.setattr(index_share, "publish", recording_publish)
    loss = net(*batch(8), None, labels=batch(8)[0]).float().mean()
    gc.collect()
    assert sorted(published) == [1, 2, 3, 7]
    assert sorted(n for n, ref in published.items() if ref() is not None) == [3, 7]
    loss.backward()  # the held top-k is what the recomputed shared layers need
    del loss
    gc.collect()
    assert all(ref() is None for ref in published.values())


def test_recompute_without_the_saved_carry_cannot_find_the_top_k():
    from support.runtime_patching import without

    from verl_npu.runtime_patches import dsa_index_share

    recomputed = model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recompute = next(p for p in dsa_index_share.PATCHES if p.id == "dsa-index-share-recompute")
    with without(recompute), pytest.raises(index_share.IndexShareError, match="has none"):
        loss_and_grads(recomputed, *batch(5))


def test_no_grad_log_probs_equal_the_training_forward():
    net = model()
    tokens, positions = batch(6)
    with index_share.record_topk() as train_trace:
        train_logits = net(tokens, positions, None).detach()
    net.eval()
    with torch.no_grad(), index_share.record_topk() as eval_trace:
        eval_logits = net(tokens, positions, None)
    torch.testing.assert_close(eval_logits, train_logits, rtol=0, atol=0)
    assert all(torch.equal(eval_trace[n][1], train_trace[n][1]) for n in train_trace)


def test_the_indexer_loss_is_computed_on_full_layers_only():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    net = model(dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=True)
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    _, grads = loss_and_grads(net, *batch(7))
    tracker = DSAIndexerLossLoggingHelper.tracker if hasattr(DSAIndexerLossLoggingHelper, "tracker") else None
    indexer_grads = {n: g for n, g in grads.items() if ".indexer." in n}
    layers_with_grads = {int(n.split(".")[2]) for n, g in indexer_grads.items() if bool(torch.count_nonzero(g))}
    assert layers_with_grads == {i for i, kind in enumerate(KINDS) if kind == "full"}
    if tracker is not None and "values" in tracker:
        logged = tracker["values"]
        assert all(float(logged[i]) == 0 for i, kind in enumerate(KINDS) if kind == "shared")
        assert all(float(logged[i]) > 0 for i, kind in enumerate(KINDS) if kind == "full")
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()


def test_megatrons_hadamard_rotation_moves_the_bf16_top_k():
    """Why GLM-5's indexer does not rotate: the reference (transformers, vLLM's bf16 path) computes index
    scores without it. Orthogonal, so exact arithmetic agrees, but rounding q and k in bf16 after the
    rotation moves keys in and out of the top-k, here at GLM-5's indexer shape (32 heads of 128)."""
    from verl_npu.ops.dsa_indexer import indexer_topk
    from verl_npu.ops.hadamard import hadamard_transform

    gen = torch.Generator().manual_seed(0)
    sq, heads, dim, topk = 512, 32, 128, 128
    q = torch.randn(sq, 1, heads, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(sq, 1, dim, generator=gen).to(torch.bfloat16)
    weights = torch.randn(sq, 1, heads, generator=gen).to(torch.bfloat16)
    plain = indexer_topk(q, k, weights, topk)
    scale = dim**-0.5
    q_rotated = hadamard_transform(q.float(), scale).to(torch.bfloat16)
    k_rotated = hadamard_transform(k.float(), scale).to(torch.bfloat16)
    rotated = indexer_topk(q_rotated, k_rotated, weights, topk)
    rows = torch.arange(sq).view(1, sq, 1)
    changed = 0
    for i in range(topk, sq):  # rows with more causal keys than the top-k: the selection is a choice
        a = set(plain[0, i][plain[0, i] <= rows[0, i]].tolist())
        b = set(rotated[0, i][rotated[0, i] <= rows[0, i]].tolist())
        changed += a != b
    assert changed > 0, "the bf16 rotation changed no selection: revisit dropping it"


# --- pipeline stages: PP=2 on CPU (gloo), the second stage beginning with a shared layer -------------------


def _run_ranks(workdir, world: int, *flags: str, timeout: float = 600) -> dict[int, dict]:
    """Run tests_npu/support/index_share_parallel.py on ``world`` ranks; their results, or their errors."""
    from support.gloo_ranks import run_ranks
    from support.paths import SUPPORT

    script = SUPPORT / "index_share_parallel.py"
    return run_ranks(script, workdir, world, *flags, timeout=timeout)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("index-share-pp")
    torch.save([batch(seed)[0] for seed in (20, 21, 22)], workdir / "batches.pt")  # three micro-batches
    single = _run_ranks(workdir, 1)
    assert "error" not in single[0], single[0]["error"]
    return workdir, single[0]


def test_pp2_whose_second_stage_begins_with_a_shared_layer_equals_pp1(pipeline_runs):
    """8 layers on 2 stages: stage 1 holds layers 4-7 and begins with shared layer 4, whose top-k comes from full
    layer 2 on stage 0, per micro-batch. Training (1F1B) and the forward-only log-prob pass equal PP=1."""
    workdir, single = pipeline_runs
    assert KINDS[4] == "shared" and KINDS[3] == "shared" and KINDS[2] == "full"
    ranks = _run_ranks(workdir, 2)
    for rank, result in ranks.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    last = ranks[1]
    assert last["losses"] == single["losses"]  # exact: the same fp32 operations in the same order
    assert last["logits"] == single["logits"]
    grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert grads.keys() == single["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, single["grads"][name], rtol=0, atol=0, msg=name)


def test_pp2_without_the_top_k_carry_fails_on_the_second_stage(pipeline_runs):
    workdir, _ = pipeline_runs
    for stale in workdir.glob("rank*-of-2.*"):
        stale.unlink()
    ranks = _run_ranks(workdir, 2, "--no-carry", timeout=300)
    assert "error" in ranks[1] and "no top-k came from the previous stage" in ranks[1]["error"], ranks[1]


def test_pp2_with_a_top_k_surviving_into_the_next_micro_batch_differs_from_pp1(pipeline_runs):
    """What the equality above rules out: stage 1 attending, for micro-batch i, over micro-batch i-1's top-k."""
    workdir, single = pipeline_runs
    for stale in workdir.glob("rank*-of-2.*"):
        stale.unlink()
    ranks = _run_ranks(workdir, 2, "--stale-carry")
    for rank, result in ranks.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    last = ranks[1]
    assert last["losses"][0] == single["losses"][0]  # the first micro-batch gets its own top-k
    assert all(ours != theirs for ours, theirs in zip(last["losses"][1:], single["losses"][1:], strict=True))
    assert last["logits"][1:] != single["logits"][1:]


# --- tensor (with sequence) and expert parallelism: TP=2 on CPU (gloo) -------------------------------------


@pytest.mark.parametrize(
    "layout", [("--tp", "2", "--sp"), ("--tp", "2", "--sp", "--ep", "2")], ids=["tp2-sp", "tp2-sp-ep2"]
)
def test_tensor_and_expert_parallel_ranks_select_and_share_what_one_rank_does(pipeline_runs, layout):
    """Both ranks compute every full layer's top-k over the whole sequence (SP gathers the indexer's input) and
    their shared layers reuse it: the same top-k as one rank, per micro-batch and layer, and its losses up to
    the order of fp32 reductions across ranks."""
    workdir, single = pipeline_runs
    for stale in workdir.glob("rank*-of-2.*"):
        stale.unlink()
    ranks = _run_ranks(workdir, 2, *layout)
    for rank, result in ranks.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        torch.testing.assert_close(result["losses"], single["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(result["logits"], single["logits"], rtol=1e-5, atol=0)
        assert len(result["topk"]) == len(single["topk"]) == 3
        for micro_batch, (ours, theirs) in enumerate(zip(result["topk"], single["topk"], strict=True)):
            assert sorted(ours) == sorted(theirs) == list(range(1, 9))
            for number, (kind, topk) in ours.items():
                assert kind == KINDS[number - 1] and topk.shape == (2, SEQ, HF.index_topk)
                assert torch.equal(topk, theirs[number][1]), (rank, micro_batch, number)
                assert torch.equal(topk, ours[latest_full(number) if kind == "shared" else number][1])
