"""What the padded (BSHD) layout costs GLM-5.2's training step against packed input, one GPU, same run (issue 28).

Routing replay for DSA models had two roads: packed (THD) input through DSA, or replay that knows the padded
layout (docs/router_replay.md). Packing's gain is the padding it removes, measured here: the step time (forward +
backward) of padded micro-batches as verl 0.9.1's engine forms them, against the same sequences run one at a
time at their own length, which is what a packed forward computes at most (each sequence causal within itself,
no padding rows; packing's own kernels are not measured, so the ratio bounds its gain from above).

Micro-batches, from the GLM-5.2 example's limits (prompts to 24k, responses to 8k, dynamic batching with
ppo_max_token_len_per_gpu 32k, so a micro-batch holds one long sequence or a few short ones): single sequences
of 4k, 8k, 16k and 32k, and 12k + 4k together; each padded to its own micro-batch's longest sequence
(``pad_bshd_to_minibatch_max=False``) and to the mini-batch's longest, 32k (verl's default True). These are
sizes within the example's limits, not lengths drawn from its data, which this benchmark does not have.

Shape: two decoder layers of GLM-5.2 as one device of the example holds them (TP 2: 32 of 64 heads; MLA with
q_lora_rank 2048, kv_lora_rank 512; the indexer's 32 heads x 128 and top-k 2048), one full DSA layer and one
shared, and an MoE whose per-token work is GLM-5.2's: 8 routed experts of 2048 (8 chosen, as GLM-5.2 chooses 8
of its 256) and one shared expert; bf16, megatron-core 0.18 on the local spec with verl-npu's runtime patches.

Run: ``python bench/padded_layout.py --out bench/results/padded_layout_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
from pathlib import Path

import torch

K = 1024
LONGEST = 32 * K  # the example's max_prompt_length + max_response_length
MICRO_BATCHES = ((4 * K,), (8 * K,), (16 * K,), (32 * K,), (12 * K, 4 * K))


def init() -> None:
    from verl_npu.testing.distributed import init_single_process

    os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")  # the device's torch differs from the Ascend pin
    init_single_process("nccl", device_index=0)


def build():
    from megatron.core import tensor_parallel
    from transformers import GlmMoeDsaConfig

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches)
    from verl_npu.testing.glm5_model import ALLGATHER_DISPATCHER, SEQUENTIAL_EXPERTS, build_glm5_model

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf = GlmMoeDsaConfig(
        vocab_size=1024, hidden_size=6144, num_hidden_layers=2, num_attention_heads=32, intermediate_size=1024,
        mlp_layer_types=["sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=2048, n_group=1, topk_group=1, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, max_position_embeddings=LONGEST, indexer_types=["full", "shared"],
    )  # fmt: skip
    model = build_glm5_model(
        hf, fused_rmsnorm=True, params_dtype=torch.bfloat16, bf16=True, **ALLGATHER_DISPATCHER, **SEQUENTIAL_EXPERTS
    )
    return model.cuda().to(torch.bfloat16), hf


def step_ms(model, vocab: int, batch: int, seq: int, repeats: int) -> float:
    """Median forward + backward time of a ``[batch, seq]`` micro-batch (causal; right padding changes no real
    token, so the padded rows are plain extra rows)."""
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    positions = torch.arange(seq, device="cuda").expand(batch, seq)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, positions, None, labels=tokens).float().mean().backward()

    step()  # warm-up: kernels, allocator
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    init()
    model, hf = build()
    alone = {}  # one sequence at its own length: the packed bound
    rows = []
    for lengths in MICRO_BATCHES:
        for n in lengths:
            if n not in alone:
                alone[n] = step_ms(model, hf.vocab_size, 1, n, args.repeats)
        packed = sum(alone[n] for n in lengths)
        own = step_ms(model, hf.vocab_size, len(lengths), max(lengths), args.repeats)
        minibatch = step_ms(model, hf.vocab_size, len(lengths), LONGEST, args.repeats)
        torch.cuda.empty_cache()
        rows.append({
            "sequences": list(lengths), "tokens": sum(lengths),
            "packed_bound_ms": packed,
            "padded_to_micro_batch_max": {"rows": len(lengths) * max(lengths), "ms": own, "ratio": own / packed},
            "padded_to_mini_batch_max": {"rows": len(lengths) * LONGEST, "ms": minibatch, "ratio": minibatch / packed},
        })  # fmt: skip
    device = torch.cuda.get_device_name()
    print(f"GLM-5.2 (2 layers per device at TP 2, DSA full + shared, MoE 8 of 8 x 2048 + shared), bf16, {device}")
    print(f"{'sequences':>14} {'packed ms':>10} {'pad micro':>10} {'x':>6} {'pad 32k':>10} {'x':>6}")
    for r in rows:
        own, mini = r["padded_to_micro_batch_max"], r["padded_to_mini_batch_max"]
        shown = "+".join(f"{n // K}k" for n in r["sequences"])
        print(
            f"{shown:>14} {r['packed_bound_ms']:>10.1f} {own['ms']:>10.1f} {own['ratio']:>6.2f} "
            f"{mini['ms']:>10.1f} {mini['ratio']:>6.2f}"
        )
    versions = {d: importlib.metadata.version(d) for d in ("torch", "megatron-core", "transformers", "triton")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "bench/padded_layout.py", "device": device, "date": datetime.date.today().isoformat(),
        "versions": versions, "shape": "2 decoder layers (full DSA + shared), hidden 6144, 32 heads (GLM-5.2 per "
        "device at TP 2), indexer 32 x 128 top-k 2048, MoE 8 routed experts of 2048 all chosen + 1 shared, bf16",
        "longest": LONGEST, "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
