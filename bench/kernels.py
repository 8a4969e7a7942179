"""Kernel benchmarks (issue 7), one GPU, same run: DSA sparse attention and RMSNorm, table + JSON.

DSA, forward+backward, top-k 2048, bf16, batch 1, random causal top-k sets (the targets' case; every
causal tile holds a selected key) and, for the tiled kernel, a local window (each query's 2048 most
recent keys), in GLM-5's two head layouts:
- per-head keys (megatron-core 0.18's MLA + DSAttention): 64 heads, qk head dim 256, v head dim
  256; megatron's ``unfused_dsa_fn`` against verl_npu's portable and Triton backends;
- absorbed MLA (MQA: one shared key head; Ascend's fused operator and FlashMLA run this form):
  64 query heads, key dim 576 (kv_lora_rank 512 + rope 64), value = the key's first 512 channels.
Time is the median of ``--repeats`` after a warm-up, synchronised wall time (milliseconds per call,
so launch overhead does not matter); memory is the peak allocated above the inputs.

DSA indexer KL loss (sparse variant, coefficient 1): top-k and loss forward, gradients to the
indexer's q, weights and k, at GLM-5's indexer shapes (32 index heads x 128, attention 64 x 256):
megatron's FusedDSAIndexerLoss against verl_npu's chunked loss.

RMSNorm, forward+backward at 16k tokens x 6144 hidden, bf16: verl_npu's Triton kernels and the
portable implementation eager and under ``torch.compile``. GPU time comes from replaying a CUDA
graph of forward+backward (``triton.testing.do_bench_cudagraph``: the kernels' time without the
Python/autograd launch overhead, which overlaps with other layers' work in a real model), also
given as eager wall time; bandwidth counts the bytes a fused kernel must move, against the device's
copy bandwidth measured in the same run.
Run: ``python bench/kernels.py --out bench/results/kernels_<device>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch

TOPK = 2048
PER_HEAD = {"layout": "per-head keys (megatron 0.18 MLA)", "heads": 64, "kv_heads": 64, "hn": 256, "hnv": 256}
ABSORBED = {"layout": "absorbed MLA (MQA)", "heads": 64, "kv_heads": 1, "hn": 576, "hnv": 512}
TARGETS = {
    "dsa_portable_vs_megatron_4k_speedup": 2.0,
    "dsa_portable_vs_megatron_4k_memory_ratio": 8.0,
    "dsa_portable_32k_peak_gib": 20.0,
    "dsa_triton_vs_portable_16k_speedup": 5.0,
    "rmsnorm_triton_fraction_of_copy": 0.8,
}


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


def measured(row: dict, step, repeats: int) -> dict:
    """``row`` with step()'s median milliseconds and peak GiB, or the out-of-memory error it hit."""
    try:
        seconds, peak = timed(step, repeats)
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {**row, "error": f"OutOfMemoryError: {str(exc)[:200]}"}
    return {**row, "fwd_bwd_ms": round(seconds * 1e3, 2), "peak_gib": round(peak / 2**30, 3)}


def causal_topk(s: int, gen: torch.Generator) -> torch.Tensor:
    """[1, s, TOPK] int32: top-k of random causal scores (s <= 8k), else uniform draws in [0, i]."""
    if s <= 8192:
        scores = torch.rand(1, s, s, device="cuda", generator=gen)
        scores.masked_fill_(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), -1.0)
        idx = scores.topk(min(TOPK, s), dim=-1).indices.to(torch.int32)
        del scores
        return idx
    rows = torch.arange(s, device="cuda").unsqueeze(1)
    # the [s, s] index scores alone would be 4 GB at 32k: draw causal indices directly
    return (torch.rand(1, s, TOPK, device="cuda", generator=gen) * (rows + 1)).floor().to(torch.int32)


def window_topk(s: int) -> torch.Tensor:
    """[1, s, TOPK] int32: each query's TOPK most recent keys (itself included; -1 where fewer exist)."""
    rows = torch.arange(s, device="cuda").view(1, s, 1)
    idx = rows - torch.arange(TOPK, device="cuda").view(1, 1, TOPK)
    return torch.where(idx >= 0, idx, -1).to(torch.int32)


def dsa_case(name: str, fn, s: int, shape: dict, repeats: int, selection: str = "random") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, hn, hnv = shape["heads"], shape["kv_heads"], shape["hn"], shape["hnv"]
    q = torch.randn(s, 1, heads, hn, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k = torch.randn(s, 1, kv_heads, hn, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    separate_value = kv_heads != 1
    v = torch.randn(s, 1, kv_heads, hnv, device="cuda", dtype=torch.bfloat16, generator=gen) if separate_value else None
    if v is not None:
        v.requires_grad_()
    idx = causal_topk(s, gen) if selection == "random" else window_topk(s)
    grad = torch.randn(s, 1, heads * hnv, device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"backend": name, "layout": shape["layout"], "s": s, "selection": selection}

    def step():
        for t in (q, k, v):
            if t is not None:
                t.grad = None
        value = v if separate_value else k[..., :hnv]  # absorbed MLA: the value is the latent part of the key
        fn(q, k, value, idx, hn**-0.5).backward(grad)

    return measured(row, step, repeats)


INDEXER = {"index_heads": 32, "index_head_dim": 128, "heads": 64, "head_dim": 256}


def indexer_loss_case(name: str, s: int, repeats: int) -> dict:
    """The DSA indexer's KL loss (top-k + loss forward, gradients to q, weights, k) at GLM-5's indexer shapes."""
    import types

    from megatron.core.transformer.experimental_attention_variant import dsa

    from verl_npu.ops import dispatch

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, ih, idim, heads, hd = 1, INDEXER["index_heads"], INDEXER["index_head_dim"], INDEXER["heads"], INDEXER["head_dim"]

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, k, weights = randn(s, b, ih, idim), randn(s, b, idim), randn(s, b, ih).abs_()
    query, key = randn(s, b, heads, hd), randn(s, b, heads, hd)
    for t in (q, k, weights):
        t.requires_grad_()
    no_tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    mask = (
        torch.triu(torch.full((s, s), float("-inf"), device="cuda"), diagonal=1)
        if name.startswith("megatron")
        else None
    )

    def step():
        for t in (q, k, weights):
            t.grad = None
        if mask is not None:  # megatron's FusedDSAIndexerLoss (fwd/bwd_fused_indexer_loss_naive), unpatched
            _, loss = dsa.FusedDSAIndexerLoss.apply(q, weights, k, query, key, hd**-0.5, TOPK, 1.0, mask, True, no_tp)
        else:
            idx = dispatch.dsa_indexer_topk(q.detach(), k.detach(), weights.detach(), TOPK, causal=True)
            loss = dispatch.dsa_indexer_loss(q, weights, k, query, key, idx, hd**-0.5, 1.0, True)
        loss.backward()

    row = {"backend": name, "s": s, "sparse_loss": True}
    return measured(row, step, repeats)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300)
    return 2 * x.numel() / (ms * 1e-3) / 1e9  # read + write


def rmsnorm_cases(repeats: int, copy_gbps: float) -> dict:
    from triton.testing import do_bench_cudagraph

    from verl_npu.ops.rmsnorm import rms_norm
    from verl_npu.ops.rmsnorm_triton import rms_norm_triton

    tokens, hidden = 16384, 6144
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    # bytes a fused kernel must move: read x, w, dy; write y, dx (+ dw, negligible)
    needed = 5 * x.numel() * x.element_size()
    compiled = torch.compile(rms_norm)
    results = {"bytes_moved": needed}
    for name, fn in (("portable eager", rms_norm), ("portable torch.compile", compiled), ("triton", rms_norm_triton)):

        def step(fn=fn):
            fn(x, w, 1e-6).backward(dy)

        wall, _ = timed(step, repeats)
        gpu_ms = do_bench_cudagraph(step, rep=100, grad_to_none=[x, w])
        results[name] = {
            "gpu_fwd_bwd_us": round(gpu_ms * 1e3, 1),
            "gpu_gbps": round(needed / (gpu_ms * 1e-3) / 1e9, 1),
            "fraction_of_copy": round(needed / (gpu_ms * 1e-3) / 1e9 / copy_gbps, 3),
            "eager_wall_fwd_bwd_us": round(wall * 1e6, 1),
        }
    # the kernels agree with the fp32 formula on these inputs
    x.grad = w.grad = None
    reference = rms_norm(x.float(), w.float(), 1e-6)
    results["triton_max_abs_error_vs_fp32"] = (rms_norm_triton(x, w, 1e-6).float() - reference).abs().max().item()
    return results


def dsa_backends() -> dict:
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from verl_npu.ops.dsa_attention import sparse_attention
    from verl_npu.ops.dsa_attention_mqa_triton import sparse_attention_mqa_triton
    from verl_npu.ops.dsa_attention_triton import sparse_attention_triton

    return {
        "megatron unfused_dsa_fn": unfused_dsa_fn,
        "verl_npu portable": sparse_attention,
        "verl_npu triton": sparse_attention_triton,
        "verl_npu triton mqa": sparse_attention_mqa_triton,
    }


def find(rows: list[dict], backend: str, layout: str, s: int) -> dict:
    """The random-selection row of that backend, layout and length (the targets' case)."""
    return next(
        (r for r in rows if (r["backend"], r["layout"], r["s"], r["selection"]) == (backend, layout, s, "random")), {}
    )


def ratio(a: dict, b: dict, key: str) -> float | None:
    if key in a and key in b and b[key]:
        return round(a[key] / b[key], 2)
    return None


def summary(result: dict) -> dict:
    rows, per_head, absorbed = result["dsa"], PER_HEAD["layout"], ABSORBED["layout"]
    megatron_4k = find(rows, "megatron unfused_dsa_fn", per_head, 4096)
    portable_4k = find(rows, "verl_npu portable", per_head, 4096)
    portable_32k = find(rows, "verl_npu portable", per_head, 32768)
    rms = result["rmsnorm_16k_x_6144_bf16"]
    s16k = 16384
    measured = {
        "dsa_portable_vs_megatron_4k_speedup": ratio(megatron_4k, portable_4k, "fwd_bwd_ms"),
        "dsa_portable_vs_megatron_4k_memory_ratio": ratio(megatron_4k, portable_4k, "peak_gib"),
        "dsa_portable_32k_peak_gib": portable_32k.get("peak_gib"),
        "dsa_triton_vs_portable_16k_speedup": {
            layout: ratio(find(rows, "verl_npu portable", layout, s16k), find(rows, triton, layout, s16k), "fwd_bwd_ms")
            for layout, triton in ((per_head, "verl_npu triton"), (absorbed, "verl_npu triton mqa"))
        },
        "rmsnorm_triton_fraction_of_copy": rms["triton"]["fraction_of_copy"],
        "rmsnorm_triton_vs_compile_speedup": round(
            rms["portable torch.compile"]["gpu_fwd_bwd_us"] / rms["triton"]["gpu_fwd_bwd_us"], 2
        ),
    }  # fmt: skip

    def met(key, value):
        if value is None:
            return None
        if key == "dsa_portable_32k_peak_gib":
            return value <= TARGETS[key]
        if isinstance(value, dict):
            return {k: (v is not None and v >= TARGETS[key]) for k, v in value.items()}
        return value >= TARGETS.get(key, 1.0)

    return {
        key: {"measured": value, "target": TARGETS.get(key, "> 1"), "met": met(key, value)}
        for key, value in measured.items()
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DSA sparse attention fwd+bwd, top-k {TOPK}, bf16 ({result['device']})")
    for column in ("layout", "selection", "backend", "s", "ms", "peak GiB"):
        table.add_column(column)
    for row in result["dsa"]:
        ms = str(row.get("fwd_bwd_ms", row.get("error", "")[:40]))
        table.add_row(row["layout"], row["selection"], row["backend"], str(row["s"]), ms, str(row.get("peak_gib", "")))
    console = Console()
    console.print(table)
    rms = Table(title=f"RMSNorm fwd+bwd 16k x 6144 bf16 (copy {result['copy_bandwidth_gbps']} GB/s)")
    for column in ("kernel", "GPU us", "GB/s", "of copy", "eager wall us"):
        rms.add_column(column)
    for name, row in result["rmsnorm_16k_x_6144_bf16"].items():
        if isinstance(row, dict):
            rms.add_row(name, str(row["gpu_fwd_bwd_us"]), str(row["gpu_gbps"]), f"{row['fraction_of_copy']:.0%}",
                        str(row["eager_wall_fwd_bwd_us"]))  # fmt: skip
    console.print(rms)
    loss = Table(title="DSA indexer KL loss (sparse), top-k + loss fwd+bwd, bf16")
    for column in ("backend", "s", "ms", "peak GiB"):
        loss.add_column(column)
    for row in result["indexer_loss"]:
        ms = str(row.get("fwd_bwd_ms", row.get("error", "")[:40]))
        loss.add_row(row["backend"], str(row["s"]), ms, str(row.get("peak_gib", "")))
    console.print(loss)
    targets = Table(title="targets (issue 7)")
    for column in ("what", "measured", "target", "met"):
        targets.add_column(column)
    for key, row in result["summary"].items():
        targets.add_row(key, str(row["measured"]), str(row["target"]), str(row["met"]))
    console.print(targets)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernels.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backends = dsa_backends()
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "triton", "megatron-core")}
        | {"cuda": torch.version.cuda},
        "shapes": {"topk": TOPK, "batch": 1, "layouts": [PER_HEAD, ABSORBED]},
        "dsa": [],
    }
    result["copy_bandwidth_gbps"] = round(copy_bandwidth(), 1)
    plan = [
        (PER_HEAD, "megatron unfused_dsa_fn", 4096, args.repeats),
        (PER_HEAD, "verl_npu portable", 4096, args.repeats),
        (PER_HEAD, "verl_npu triton", 4096, args.repeats),
        (PER_HEAD, "verl_npu portable", 16384, 2),
        (PER_HEAD, "verl_npu triton", 16384, 2),
        (PER_HEAD, "megatron unfused_dsa_fn", 32768, 1),
        (PER_HEAD, "verl_npu portable", 32768, 1),
        (PER_HEAD, "verl_npu triton", 32768, 1),
        (ABSORBED, "verl_npu portable", 4096, args.repeats),
        (ABSORBED, "verl_npu triton mqa", 4096, args.repeats),
        (ABSORBED, "verl_npu portable", 16384, 2),
        (ABSORBED, "verl_npu triton mqa", 16384, 2),
    ]
    # top-k sets with locality: the tiled kernel skips the tiles without a selected key
    plan += [(PER_HEAD, "verl_npu portable", 16384, 2, "window"), (PER_HEAD, "verl_npu triton", 16384, 2, "window")]
    for shape, name, s, repeats, *selection in plan:
        result["dsa"].append(dsa_case(name, backends[name], s, shape, repeats, *selection))
        print(json.dumps(result["dsa"][-1]), flush=True)
    result["indexer_loss_shapes"] = INDEXER
    result["indexer_loss"] = [
        indexer_loss_case("megatron FusedDSAIndexerLoss", 4096, args.repeats),
        indexer_loss_case("verl_npu portable", 4096, args.repeats),
        indexer_loss_case("megatron FusedDSAIndexerLoss", 32768, 1),
        indexer_loss_case("verl_npu portable", 32768, 2),
    ]
    for row in result["indexer_loss"]:
        print(json.dumps(row), flush=True)
    result["rmsnorm_16k_x_6144_bf16"] = rmsnorm_cases(args.repeats, result["copy_bandwidth_gbps"])
    result["summary"] = summary(result)
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
