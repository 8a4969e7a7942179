"""Kernel benchmarks (issue 7), one GPU, same run: DSA sparse attention and RMSNorm, table + JSON.

DSA: forward+backward at GLM-5 head shapes (64 heads, qk head dim 256, v head dim 256, top-k 2048),
megatron-core 0.18's ``unfused_dsa_fn`` against verl_npu's portable backend; time is the median of
``--repeats`` after a warm-up, memory the peak allocated above the inputs. RMSNorm: forward+backward
at 16k tokens x 6144 hidden, bf16: verl_npu's Triton kernels, the portable implementation eager and
under ``torch.compile``, against the device's copy bandwidth measured in the same run.
Run: ``python bench/kernels.py --out kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, HN, HNV, TOPK = 64, 256, 256, 2048


def timed(fn, repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes allocated above what was allocated before) of fn()."""
    fn()  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    times = []
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def dsa_inputs(s: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, 1, HEADS, HN, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(s, 1, HEADS, HN, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    v = torch.randn(s, 1, HEADS, HNV, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    # causal top-k like the indexer's (random scores; padded with the last position when k > i + 1)
    scores = torch.rand(1, s, s, device="cuda", generator=gen) if s <= 8192 else None
    if scores is not None:
        scores.masked_fill_(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), -1.0)
        idx = scores.topk(min(TOPK, s), dim=-1).indices.to(torch.int32)
        del scores
    else:  # 32k: the [s, s] index scores alone would be 4 GB; draw causal indices directly
        rows = torch.arange(s, device="cuda").unsqueeze(1)
        idx = (torch.rand(1, s, TOPK, device="cuda", generator=gen) * (rows + 1)).floor().to(torch.int32)
    grad = torch.randn(s, 1, HEADS * HNV, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, idx, grad


def dsa_case(name: str, fn, s: int, repeats: int) -> dict:
    q, k, v, idx, grad = dsa_inputs(s)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, idx, HN**-0.5).backward(grad)

    try:
        seconds, peak = timed(step, repeats)
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"backend": name, "s": s, "error": f"OutOfMemoryError: {str(exc)[:200]}"}
    return {"backend": name, "s": s, "fwd_bwd_ms": round(seconds * 1e3, 2), "peak_gib": round(peak / 2**30, 3)}


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    seconds, _ = timed(lambda: y.copy_(x), 20)
    return 2 * x.numel() / seconds / 1e9  # read + write


def rmsnorm_cases(repeats: int) -> dict:
    from verl_npu.ops.rmsnorm import rms_norm
    from verl_npu.ops.rmsnorm_triton import rms_norm_triton

    tokens, hidden = 16384, 6144
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    # bytes a fused kernel must move: read x, w, dy; write y, dx (+ dw, negligible)
    needed = 5 * x.numel() * x.element_size()
    compiled = torch.compile(rms_norm)
    results = {}
    for name, fn in (("portable eager", rms_norm), ("portable torch.compile", compiled), ("triton", rms_norm_triton)):

        def step(fn=fn):
            x.grad = w.grad = None
            fn(x, w, 1e-6).backward(dy)

        seconds, _ = timed(step, repeats)
        results[name] = {"fwd_bwd_ms": round(seconds * 1e3, 3), "effective_gbps": round(needed / seconds / 1e9, 1)}
    # the kernels agree with the fp32 formula on these inputs
    x.grad = w.grad = None
    reference = rms_norm(x.float(), w.float(), 1e-6)
    results["triton_max_abs_error_vs_fp32"] = (rms_norm_triton(x, w, 1e-6).float() - reference).abs().max().item()
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from megatron.core import __version__ as mcore
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from verl_npu.ops.dsa_attention import sparse_attention

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "megatron_core": mcore,
        "shapes": {"heads": HEADS, "qk_head_dim": HN, "v_head_dim": HNV, "topk": TOPK, "batch": 1},
        "dsa": [],
    }
    result["copy_bandwidth_gbps"] = round(copy_bandwidth(), 1)
    for s in (4096,):
        result["dsa"].append(dsa_case("megatron unfused_dsa_fn", unfused_dsa_fn, s, args.repeats))
        result["dsa"].append(dsa_case("verl_npu portable", sparse_attention, s, args.repeats))
    result["dsa"].append(dsa_case("megatron unfused_dsa_fn", unfused_dsa_fn, 32768, 1))
    result["dsa"].append(dsa_case("verl_npu portable", sparse_attention, 32768, 1))
    result["rmsnorm_16k_x_6144_bf16"] = rmsnorm_cases(args.repeats)
    for row in result["dsa"]:
        print(json.dumps(row))
    print(json.dumps(result["rmsnorm_16k_x_6144_bf16"]), "copy GB/s", result["copy_bandwidth_gbps"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
