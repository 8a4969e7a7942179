"""The parity job with a fault injected into the engine: upstream's GLM-5 train/rollout mismatches (issue 19) or a
realistic porting fault (issue 30).

Test-only: each injection is a bug, patched into this process's verl-npu engine before the job builds its model (or
into the model it built), so that tests_npu/parity/test_parity.py and tests_npu/parity/test_parity_faults.py can show
the comparison catches it and names the module. The first five stand in for the mismatches upstream found between
Ascend's and the reference's numerics (docs/upstream_facts.md):

- ``k_norm_eps``: the indexer's key norm with megatron-core's eps (the model's layernorm_epsilon, 1e-5) instead of
  the reference's 1e-6;
- ``hadamard``: megatron's Hadamard rotation of the indexer's q and k, which the reference's bf16 path skips;
- ``shared_own_topk``: GLM-5.2's shared layers computing their own top-k (with the latest full layer's indexer)
  instead of reusing the full layer's;
- ``topk_leak``: a shared layer reading the top-k of the previous micro-batch;
- ``norm_upcast``: one norm (layer 2's input norm) multiplying its weight after rounding to bf16, where the engine's
  RMSNorm does the whole computation in fp32 (an fp32 upcast present on one side only).

Porting faults (issue 30): bugs a port of the engine to another platform or kernel library could ship, each patched
into the code the CPU job really runs (megatron-core 0.18, verl_npu.ops' portable operators, verl_npu.engine). After
each, the checksum point (verl_npu/parity/probes.py) whose tensor first differs, the module a layer-by-layer
comparison should name (``glm5_2``: layers 0-2 have a dense MLP, layer 3 is the first MoE layer; inside a full DSA
layer the indexer's points come before the attention's output; ``dense``: Qwen2.5 shrunk):

- ``router_ignores_bias``: the MoE router picks its experts from the sigmoid scores without the score-correction
  bias (``e_score_correction_bias`` not passed to the selection). ``layers.3.mlp``.
- ``router_activation_dtype``: the router's gate and scores in the activations' dtype, the config's
  ``moe_router_dtype`` fp32 ignored; bf16 runs only (an fp32 run computes the same). ``layers.3.mlp``.
- ``router_unscaled``: the routing weights without ``routed_scaling_factor`` (2.5). ``layers.3.mlp``.
- ``mla_norm_eps``: MLA's q and kv latent RMSNorms with eps 1e-6 (transformers' hard-coded value) instead of the
  config's ``rms_norm_eps``. ``layers.0.indexer.q`` (the normed q latent is the indexer's query input).
- ``rmsnorm_low_precision``: every RMSNorm reduces its variance and normalises in the activations' dtype instead of
  fp32; bf16 runs only. ``layers.0.indexer.k_norm`` (layer 0's input norm feeds the indexer's key first).
- ``mla_rope_half_split``: MLA's rotary embedding of q_pe/k_pe rotates half-split pairs (i, i + d/2) where the
  checkpoint's layout (``rope_interleave``) is interleaved (2i, 2i+1). ``layers.0.self_attention``.
- ``indexer_rope_half_split``: the same in the DSA indexer's q/k (``indexer_rope_interleave``). ``layers.0.indexer.q``.
- ``rope_theta_default``: the rotary base left at megatron's default 10000 where the checkpoint's
  ``rope_parameters.rope_theta`` says otherwise (GLM-5.2: 8e6), as a config mapping that reads ``rope_theta`` from the
  config's root only, where transformers 5 no longer puts it; MLA and the indexer both rotate with it.
  ``layers.0.indexer.q``.
- ``softmax_scale_nope``: MLA's attention scale 1/sqrt(qk_nope_head_dim), the RoPE dims left out of the head dim.
  ``layers.0.self_attention``.
- ``attention_mask_diagonal``: the sparse attention's causal mask one position too strict: a query cannot attend to
  its own key (``triu(diagonal=0)``). ``layers.0.self_attention``.
- ``indexer_mask_ahead``: the indexer's causal mask one position too loose: a query may select the next key, which the
  attention then drops, so it attends over top-k - 1 keys. ``layers.0.self_attention`` (q/k of the indexer agree).
- ``attention_softmax_bf16``: the sparse attention's scores and softmax in bf16 whatever the run's dtype (a kernel
  with a bf16 softmax only). ``layers.0.self_attention``.
- ``moe_combine_bf16``: the MoE routing weights rounded to bf16 and the weighted expert outputs summed in bf16
  whatever the run's dtype. ``layers.3.mlp``.
- ``qkv_bias_dropped`` (``dense``): Qwen2's q/k/v biases not loaded (left at zero). ``layers.0.self_attention``.
- ``gqa_tiled``: grouped-query attention's key/value groups repeated as tiles (head h reads group h % groups) where
  every group serves consecutive query heads (h // (heads / groups)) (``dense``). ``layers.0.self_attention``.

    python tests_npu/support/parity_injections.py --inject k_norm_eps --dtype fp32 --out run.json [--model glm5_2]
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

UPSTREAM = ("k_norm_eps", "hadamard", "shared_own_topk", "topk_leak", "norm_upcast")
PORTING = (
    "router_ignores_bias", "router_activation_dtype", "router_unscaled", "mla_norm_eps", "rmsnorm_low_precision",
    "mla_rope_half_split", "indexer_rope_half_split", "rope_theta_default", "softmax_scale_nope",
    "attention_mask_diagonal", "indexer_mask_ahead", "attention_softmax_bf16", "moe_combine_bf16", "qkv_bias_dropped",
    "gqa_tiled",
)  # fmt: skip
# Each porting fault changes the modules it names and nothing else: a model without them (the router's faults in
# ``dense``, Qwen2's in ``glm5_2``) runs unchanged, so the CLI's default (both models) stays valid for every fault.
INJECTIONS = ("none", *UPSTREAM, *PORTING)
TRANSFORMERS_LATENT_NORM_EPS = 1e-6  # transformers' GlmMoeDsa hard-codes it for the q/kv latent norms


def _spec_with(**fields):
    from verl_npu.engine import index_share

    index_share.IndexShareSpec = functools.partial(index_share.IndexShareSpec, **fields)


def _shared_layers_select_for_themselves() -> None:
    import torch
    from megatron.core.transformer.experimental_attention_variant import dsa

    from verl_npu.engine import index_share

    shared = index_share.classes()[1]

    def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        sq, skv = query.size(0), key.size(0)
        mask = torch.triu(torch.full((sq, skv), float("-inf"), dtype=torch.float32, device=x.device), diagonal=1)
        with index_share._source_scope(self.layer_number, rotate=False):  # the reference's numerics, as a full layer
            _, topk = self._own_indexer[0].forward_with_scores(x.detach(), qr.detach(), mask=mask)
        return dsa.unfused_dsa_fn(query, key, value, topk, self.softmax_scale)

    shared.forward = forward


def _attach_own_indexers(built) -> None:
    latest = None
    for layer in built.gpt.decoder.layers:
        core = layer.self_attention.core_attention
        if hasattr(core.indexer, "k_norm"):
            latest = core.indexer
        else:
            core._own_indexer = [latest]  # a list: not registered as a submodule (no parameters of its own)


def _previous_micro_batch_topk() -> None:
    from verl_npu.engine import index_share

    original = index_share.carried
    seen: dict[int, object] = {}

    def carried(layer_number):
        current = original(layer_number)
        previous = seen.get(layer_number)
        seen[layer_number] = current
        return current if previous is None or previous.shape != current.shape else previous

    index_share.carried = carried


def _bf16_weight_multiply(built) -> None:
    import torch

    norm = built.gpt.decoder.layers[2].input_layernorm

    def forward(x):
        x32 = x.float()
        normalized = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)
        return normalized * norm.weight  # the weight multiply in bf16: a second rounding

    norm.forward = forward


# --- porting faults (module docstring) ------------------------------------------------------------------------------
def _routing_called_with(**overrides) -> None:
    """The router's top-k selection called with some of its arguments replaced (megatron-core's TopKRouter.routing
    looks the function up in its module at each call)."""
    from megatron.core.transformer.moe import router

    original = router.topk_routing_with_score_function

    @functools.wraps(original)
    def routing(*args, **kwargs):
        return original(*args, **{**kwargs, **overrides})

    router.topk_routing_with_score_function = routing


def _router_in_activation_dtype() -> None:
    from megatron.core.transformer.moe import router

    original = router.router_gating_linear

    def gating_linear(inp, weight, bias, router_dtype):
        return original(inp, weight, bias, inp.dtype)  # the configured router dtype (fp32) dropped

    router.router_gating_linear = gating_linear


def _latent_norms_eps(built) -> None:
    if not built.gpt.config.multi_latent_attention:
        return  # a model without MLA (dense) has no latent norms: it runs unchanged
    for layer in built.gpt.decoder.layers:
        attention = layer.self_attention
        for norm in (attention.q_layernorm, attention.kv_layernorm):
            norm.eps = TRANSFORMERS_LATENT_NORM_EPS


def _norms_in_activation_dtype(built) -> None:
    import torch

    def low_precision(norm):
        original = norm.forward

        def forward(x):
            if x.dtype in (torch.float32, torch.float64):
                return original(x)  # the activations' dtype is the engine's own here: nothing to lose
            variance = x.pow(2).mean(-1, keepdim=True)  # squares and their mean rounded to x's dtype
            return x * torch.rsqrt(variance + norm.eps) * norm.weight

        return forward

    norms = [m for m in built.gpt.modules() if isinstance(m, torch.nn.RMSNorm)]
    if not norms:
        raise RuntimeError("rmsnorm_low_precision: the model has no torch.nn.RMSNorm (another layer spec?)")
    for norm in norms:
        norm.forward = low_precision(norm)


def _rope_half_split(module_name: str) -> None:
    """``module_name``'s RoPE calls without megatron's MLA de-interleaving: pairs (i, i + d/2) rotate where the
    checkpoint's are (2i, 2i+1) (both MLA and the DSA indexer import apply_rotary_pos_emb into their module)."""
    import importlib

    from megatron.core.models.common.embeddings import rope_utils

    module = importlib.import_module(module_name)
    original = module.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if cu_seqlens is not None:  # packed sequences: the parity job runs none
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t, freqs, rotary_interleaved=config.rotary_interleaved, multi_latent_attention=False, mscale=mscale
        )

    module.apply_rotary_pos_emb = apply_rotary_pos_emb


MEGATRON_DEFAULT_ROTARY_BASE = 10000


def _default_rotary_base(built) -> None:
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotaries = [m for m in built.gpt.modules() if isinstance(m, RotaryEmbedding)]
    if not rotaries:
        raise RuntimeError("rope_theta_default: the model has no megatron RotaryEmbedding")
    for rotary in rotaries:  # before the first forward: RotaryEmbedding caches its frequencies per length
        dim = 2 * rotary.inv_freq.numel()
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim
        rotary.inv_freq = 1.0 / (MEGATRON_DEFAULT_ROTARY_BASE**exponents)


def _softmax_scale_without_rope(built) -> None:
    import math

    config = built.gpt.config
    if not config.multi_latent_attention:
        return  # only MLA splits its query/key head into nope and RoPE dims
    for layer in built.gpt.decoder.layers:
        layer.self_attention.core_attention.softmax_scale = 1.0 / math.sqrt(config.qk_head_dim)  # nope dims only


def _attention_mask_without_diagonal() -> None:
    import torch

    from verl_npu.ops import dsa_attention

    original = dsa_attention._selection_mask

    def selection_mask(topk_indices, rows, skv):
        mask = original(topk_indices, rows, skv)
        own = torch.arange(rows.start, rows.start + mask.shape[1], device=mask.device)
        diagonal = torch.arange(skv, device=mask.device).unsqueeze(0) == own.unsqueeze(1)
        return mask & ~diagonal.unsqueeze(0)

    dsa_attention._selection_mask = selection_mask


def _indexer_mask_one_ahead() -> None:
    import torch

    from verl_npu.ops import dsa_indexer

    def indexer_topk(q, k, weights, topk, *, causal=True, **_):
        sq, skv = q.shape[0], k.shape[0]
        with torch.no_grad():
            scores = torch.einsum("sbhd,tbd->bsht", q.float(), k.float()).relu()
            scores = (scores * weights.float().permute(1, 0, 2).unsqueeze(-1)).sum(2)  # [b, sq, skv]
            if causal:
                ahead = torch.arange(skv, device=q.device).unsqueeze(0) > torch.arange(sq, device=q.device)[:, None] + 1
                scores = scores.masked_fill(ahead, float("-inf"))
            return scores.topk(min(topk, skv), dim=-1).indices

    dsa_indexer.indexer_topk = indexer_topk


def _attention_softmax_in_bf16() -> None:
    import torch

    from verl_npu.ops import dsa_attention

    def sdpa(q, k, v, mask, scale):
        scores = (q @ k.transpose(-1, -2)).to(torch.bfloat16) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v

    dsa_attention._sdpa = sdpa


def _moe_combine_in_bf16() -> None:
    import torch
    from megatron.core.transformer.moe import experts, token_dispatcher

    expert_forward = experts.SequentialMLP.forward

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        weights = permuted_probs.to(torch.bfloat16)  # the routing weights as a bf16-only kernel takes them
        return expert_forward(self, permuted_local_hidden_states, tokens_per_expert, weights)

    experts.SequentialMLP.forward = forward
    unpermute = token_dispatcher.unpermute

    def combine(permuted_tokens, *args, **kwargs):
        return unpermute(permuted_tokens.to(torch.bfloat16), *args, **kwargs).to(permuted_tokens.dtype)

    token_dispatcher.unpermute = combine


def _qkv_bias_not_loaded(built) -> None:
    import torch

    qkv = [getattr(layer.self_attention, "linear_qkv", None) for layer in built.gpt.decoder.layers]
    biases = [linear.bias for linear in qkv if linear is not None and linear.bias is not None]
    if not biases:
        return  # a model without q/k/v biases (GLM-5.2's MLA) runs unchanged
    with torch.no_grad():
        for bias in biases:
            bias.zero_()
    # the optimizer's main copy (bf16 runs) too, as if the bias had never been loaded
    reload = getattr(built.optimizer, "reload_model_params", None)
    if reload is not None:
        reload()


def _gqa_tiled() -> None:
    from verl_npu.engine.packed_attention import PackedDotProductAttention

    original = PackedDotProductAttention.forward

    def forward(self, query, key, value, *args, **kwargs):
        groups, heads = self.num_query_groups_per_partition, self.num_attention_heads_per_partition
        if groups == heads:
            return original(self, query, key, value, *args, **kwargs)
        key, value = (t.repeat(1, 1, heads // groups, 1) for t in (key, value))  # [s, b, groups, d] tiled
        self.num_query_groups_per_partition = heads  # megatron must not expand them a second time
        try:
            return original(self, query, key, value, *args, **kwargs)
        finally:
            self.num_query_groups_per_partition = groups

    PackedDotProductAttention.forward = forward


# name -> what it patches before the job builds its model (module-level code the build or the forward looks up)
_BEFORE_BUILD: dict[str, Callable[[], None]] = {
    "k_norm_eps": lambda: _spec_with(k_norm_eps=None),
    "hadamard": lambda: _spec_with(rotate_indexer=True),
    "shared_own_topk": _shared_layers_select_for_themselves,
    "topk_leak": _previous_micro_batch_topk,
    "router_ignores_bias": lambda: _routing_called_with(expert_bias=None),
    "router_activation_dtype": _router_in_activation_dtype,
    "router_unscaled": lambda: _routing_called_with(scaling_factor=None),
    "mla_rope_half_split": lambda: _rope_half_split("megatron.core.transformer.multi_latent_attention"),
    "indexer_rope_half_split": lambda: _rope_half_split("megatron.core.transformer.experimental_attention_variant.dsa"),
    "attention_mask_diagonal": _attention_mask_without_diagonal,
    "indexer_mask_ahead": _indexer_mask_one_ahead,
    "attention_softmax_bf16": _attention_softmax_in_bf16,
    "moe_combine_bf16": _moe_combine_in_bf16,
    "gqa_tiled": _gqa_tiled,
}
# name -> what it changes in the built model (its modules' attributes and weights)
_AFTER_BUILD: dict[str, Callable[[Any], None]] = {
    "shared_own_topk": _attach_own_indexers,
    "norm_upcast": _bf16_weight_multiply,
    "mla_norm_eps": _latent_norms_eps,
    "rmsnorm_low_precision": _norms_in_activation_dtype,
    "rope_theta_default": _default_rotary_base,
    "softmax_scale_nope": _softmax_scale_without_rope,
    "qkv_bias_dropped": _qkv_bias_not_loaded,
}


def inject(name: str) -> None:
    """Patch fault ``name`` into this process's engine (call after job.start_device, before job.run)."""
    if name not in INJECTIONS:
        raise ValueError(f"inject {name!r}: choose one of {', '.join(INJECTIONS)}")
    from verl_npu.parity import job

    if name in _BEFORE_BUILD:
        _BEFORE_BUILD[name]()
    after_build = _AFTER_BUILD.get(name)
    if after_build is not None:
        build = job.build

        def patched(*args, **kwargs):
            built = build(*args, **kwargs)
            after_build(built)
            return built

        job.build = patched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inject", choices=INJECTIONS, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--model", action="append")
    parser.add_argument("--out", required=True)
    parser.add_argument("--replay-from", help="as `verl-npu parity run --replay-from`")
    args = parser.parse_args(argv)
    from verl_npu.parity import job

    options = job.RunOptions(models=tuple(args.model or job.DEFAULT_MODELS), dtype=args.dtype,
                             replay_from=args.replay_from)  # fmt: skip
    job.start_device()  # the runtime layer is loaded first: injections patch its modules
    inject(args.inject)
    job.write(job.run(options), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
