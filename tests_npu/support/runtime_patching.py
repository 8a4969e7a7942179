"""Run code under megatron's upstream behaviour or with one of verl-npu's runtime patches applied."""

from __future__ import annotations

import contextlib
import importlib

from verl_npu import megatron_adaptor
from verl_npu.patching import APPLIED, Patch


@contextlib.contextmanager
def without(*patches: Patch):
    """The upstream behaviour: revert our patches for the duration, re-apply them after."""
    engine = megatron_adaptor.load().engine
    for patch in patches:
        importlib.import_module(patch.module)  # resolves a pending patch first
        engine.revert(patch)
    try:
        yield
    finally:
        for patch in patches:
            engine.apply(patch)


def applied(patch: Patch) -> None:
    engine = megatron_adaptor.load().engine
    importlib.import_module(patch.module)
    engine.apply(patch)
    assert engine.record(patch.id).status == APPLIED, engine.record(patch.id)


def count_dense_index_scores(monkeypatch) -> list:
    """A list that grows by one each time megatron's ``fused_qk_topk_naive`` builds dense DSA index scores."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    calls = []
    naive = dsa.fused_qk_topk_naive
    monkeypatch.setattr(dsa, "fused_qk_topk_naive", lambda *a, **k: calls.append(1) or naive(*a, **k))
    return calls


def dsa_config():
    """A one-layer MLA config with a DSA core, small enough for the CPU."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, use_cpu_initialization=True,
        normalization="RMSNorm", experimental_attention_variant="dsa", dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=16, dsa_indexer_topk=4, dsa_indexer_loss_coeff=0.0, rope_type="rope",
        apply_rope_fusion=False, params_dtype=torch.float32,
    )  # fmt: skip
