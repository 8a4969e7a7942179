"""IndexShare benchmark (issue 15), one GPU, same run: the DSA indexer's cost per training step with GLM-5.2's
shared layers against every layer computing its own top-k, and the pipeline carry's bytes and time.

Shape, scaled from the GLM-5.2 example's per-device shape (TP 2: 32 of the 64 attention heads per device,
the indexer's 32 heads x 128 and top-k 2048 unchanged) to one GPU: 8 decoder layers of GLM-5's attention
(hidden 6144, q_lora_rank 2048, kv_lora_rank 512, heads of 192 + 64 rope / 256 value), a small dense MLP
(the MLP does not change with IndexShare), batch 1, bf16, megatron-core 0.18 on the local spec with
verl-npu's runtime patches (chunked indexer top-k, sparse attention on this GPU's Triton/portable backend),
sequence lengths 4k and 8k. The 8 layers follow GLM-5.2's pattern (its layers 10-17: 2 full, 6 shared)
against the same 8 layers all full. Per training step (forward + backward): the time in the indexer
(CUDA events around its projections, ``DSAIndexer.forward_before_topk``, and its top-k,
``fwd_fused_indexer_loss_naive``; at dsa_indexer_loss_coeff=0, RL's setting, the indexer's backward
is zeros), the step time and the peak memory allocated above the weights.

The carry: the top-k a stage sends per micro-batch ([b, s, k] as int32, plus a 3-element header) and the
time to pack it on the device (int64 -> int32, contiguous); the transfer itself needs two GPUs and is measured by
bench/index_share_carry.py (PP=2 over NCCL, in megatron's schedule).

Run: ``python bench/index_share.py --out bench/results/index_share_<device>.json``.
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

from verl_npu.models.glm5.config import glm5_2_indexer_types

TOPK, LAYERS = 2048, 8
GLM5_2_STAGE = glm5_2_indexer_types(78)[10:18]


def init() -> None:
    from verl_npu.testing.distributed import init_single_process

    os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")  # the device's torch differs from the Ascend pin
    init_single_process("nccl", device_index=0)


def build(kinds: list[str], seq: int):
    from megatron.core import tensor_parallel
    from transformers import GlmMoeDsaConfig

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches)
    from verl_npu.testing.glm5_model import build_glm5_model

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    # a model whose 8 layers are this stage's: layer 0 stands in for the full layer before the stage
    hf = GlmMoeDsaConfig(
        vocab_size=1024, hidden_size=6144, num_hidden_layers=LAYERS, num_attention_heads=32, intermediate_size=1024,
        mlp_layer_types=["dense"] * LAYERS, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=TOPK,
        max_position_embeddings=seq, indexer_types=["full", *kinds[1:]],
    )  # fmt: skip
    model = build_glm5_model(hf, fused_rmsnorm=True, params_dtype=torch.bfloat16, bf16=True)
    return model.cuda().to(torch.bfloat16), hf


def measure(kinds: list[str], seq: int, repeats: int) -> dict:
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    model, hf = build(kinds, seq)

    indexer_ms: list[float] = []
    pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(fn):
        def run(*args, **kwargs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn(*args, **kwargs)
            end.record()
            pending.append((begin, end))
            return out

        return run

    indexers = [m for m in model.modules() if isinstance(m, DSAIndexer)]
    saved = (DSAIndexer.forward_before_topk, dsa.fwd_fused_indexer_loss_naive)
    DSAIndexer.forward_before_topk = timed(saved[0])
    dsa.fwd_fused_indexer_loss_naive = timed(saved[1])
    tokens = torch.randint(0, hf.vocab_size, (1, seq), device="cuda")
    positions = torch.arange(seq, device="cuda").unsqueeze(0)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()

    step()  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        pending.clear()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
        indexer_ms.append(sum(b.elapsed_time(e) for b, e in pending))
    DSAIndexer.forward_before_topk, dsa.fwd_fused_indexer_loss_naive = saved
    result = {
        "layers_with_indexer": len(indexers),
        "indexer_params": sum(p.numel() for m in indexers for p in m.parameters()),
        "indexer_ms_per_step": statistics.median(indexer_ms),
        "step_ms": statistics.median(times),
        "peak_gib_above_weights": (torch.cuda.max_memory_allocated() - weights) / 2**30,
    }
    return result


def carry(seq: int, repeats: int) -> dict:
    topk = torch.randint(0, seq, (1, seq, TOPK), device="cuda", dtype=torch.int64)
    packed = topk.to(torch.int32).contiguous()
    times = []
    for _ in range(repeats + 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        packed = topk.to(torch.int32).contiguous()
        unpacked = packed.long()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    del unpacked
    return {
        "bytes_per_microbatch": packed.numel() * packed.element_size() + 3 * 8,
        "pack_and_unpack_ms": statistics.median(times[1:]),
        "transfer": "not measured: needs two GPUs (nvidia-h200-x2 not lent)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    init()
    rows = []
    for seq in args.seqs:
        shared = measure(GLM5_2_STAGE, seq, args.repeats)
        torch.cuda.empty_cache()
        full = measure(["full"] * LAYERS, seq, args.repeats)
        torch.cuda.empty_cache()
        rows.append({
            "seq": seq, "index_share": shared, "all_full": full,
            "indexer_time_ratio": shared["indexer_ms_per_step"] / full["indexer_ms_per_step"],
            "step_time_ratio": shared["step_ms"] / full["step_ms"],
            "peak_memory_ratio": shared["peak_gib_above_weights"] / full["peak_gib_above_weights"],
            "carry": carry(seq, args.repeats),
        })  # fmt: skip
    print(f"IndexShare vs all-full, {LAYERS} layers ({GLM5_2_STAGE.count('full')} full in the GLM-5.2 stage), "
          f"top-k {TOPK}, bf16, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'seq':>6} {'layers w/ indexer':>18} {'indexer ms':>16} {'step ms':>16} {'peak GiB':>14} "
          f"{'carry MiB':>10} {'pack ms':>8}")  # fmt: skip
    for r in rows:
        s, f, c = r["index_share"], r["all_full"], r["carry"]
        print(
            f"{r['seq']:>6} {s['layers_with_indexer']:>8} vs {f['layers_with_indexer']:<7} "
            f"{s['indexer_ms_per_step']:>7.1f} vs {f['indexer_ms_per_step']:<6.1f} "
            f"{s['step_ms']:>7.1f} vs {f['step_ms']:<6.1f} {s['peak_gib_above_weights']:>5.2f} vs "
            f"{f['peak_gib_above_weights']:<5.2f} {c['bytes_per_microbatch'] / 2**20:>10.1f} "
            f"{c['pack_and_unpack_ms']:>8.3f}"
        )
    versions = {d: importlib.metadata.version(d) for d in ("torch", "megatron-core", "transformers", "triton")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "bench/index_share.py", "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(), "versions": versions, "top_k": TOPK, "layers": LAYERS,
        "stage_kinds": GLM5_2_STAGE, "shape": "hidden 6144, 32 heads (GLM-5.2 per device at TP 2), "
        "indexer 32 x 128, dense MLP 1024, batch 1, bf16", "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
