"""The parity job with one of upstream's GLM-5 train/rollout mismatches injected into the engine (issue 19).

Test-only: each injection is a bug, patched into this process's verl-npu engine before the job builds its model,
so that tests_npu/test_parity.py can show the comparison catches it and names the layer. They stand in for the
mismatches upstream found between Ascend's and the reference's numerics (shared/reference.md, section 5):

- ``k_norm_eps``: the indexer's key norm with megatron-core's eps (the model's layernorm_epsilon, 1e-5) instead of
  the reference's 1e-6;
- ``hadamard``: megatron's Hadamard rotation of the indexer's q and k, which the reference's bf16 path skips;
- ``shared_own_topk``: GLM-5.2's shared layers computing their own top-k (with the latest full layer's indexer)
  instead of reusing the full layer's;
- ``topk_leak``: a shared layer reading the top-k of the previous micro-batch;
- ``norm_upcast``: one norm (layer 2's input norm) multiplying its weight after rounding to bf16, where the engine's
  RMSNorm does the whole computation in fp32 (an fp32 upcast present on one side only).

    python tests_npu/support/parity_injections.py --inject k_norm_eps --dtype fp32 --out run.json [--model glm5_2]
"""

from __future__ import annotations

import argparse
import functools
import sys

INJECTIONS = ("none", "k_norm_eps", "hadamard", "shared_own_topk", "topk_leak", "norm_upcast")


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


def inject(name: str) -> None:
    from verl_npu.parity import job

    after_build = None
    if name == "k_norm_eps":
        _spec_with(k_norm_eps=None)
    elif name == "hadamard":
        _spec_with(rotate_indexer=True)
    elif name == "shared_own_topk":
        _shared_layers_select_for_themselves()
        after_build = _attach_own_indexers
    elif name == "topk_leak":
        _previous_micro_batch_topk()
    elif name == "norm_upcast":
        after_build = _bf16_weight_multiply
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
    args = parser.parse_args(argv)
    from verl_npu.parity import job

    options = job.RunOptions(models=tuple(args.model or job.DEFAULT_MODELS), dtype=args.dtype)
    job.start_device()  # the runtime layer is loaded first: injections patch its modules
    inject(args.inject)
    job.write(job.run(options), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
