"""Benchmark: verl-npu's offload manager vs verl 0.9.1's offload helpers, same model, same run.

Builds a GPT with megatron-core (default about 735M parameters, bf16 with fp32 main parameters,
DDP + distributed optimizer, world size 1), takes one training step so that the optimizer state
exists, then measures on the accelerator:
  ours: first optimizer offload after construction (arena allocated in the background), steady
        offload / onload of params + grads + optimizer, parameter snapshot to host, device memory
        left after a full offload, host memory added per offloaded byte;
  verl: offload_megatron_model_to_cpu / load_megatron_model_to_gpu, offload_megatron_optimizer
        (first and steady) / load_megatron_optimizer, copy_megatron_model_to_cpu.
Prints a table and writes JSON (device and versions included). Needs CUDA (or an NPU).

    python bench/offload.py --out bench/results/offload_h100.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import json
import os
import platform
import resource
import time
from pathlib import Path

import torch
from megatron_gpt import build_gpt, init_single_gpu
from megatron_gpt import train_step as run_train_step
from rich.console import Console
from rich.table import Table

GB = 1e9


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(hidden: int, layers: int, vocab: int, seq: int):
    init_single_gpu()
    return build_gpt(hidden, layers, vocab, seq)


def train_step(ddp, optimizer, vocab: int, seq: int) -> float:
    tokens = torch.randint(0, vocab, (1, seq), device="cuda")
    positions = torch.arange(seq, device="cuda").unsqueeze(0)
    return run_train_step(ddp, optimizer, tokens, positions).item()


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from verl_npu.engine.offload import OffloadManager

    ddp, optimizer = build(args.hidden, args.layers, args.vocab, args.seq)
    n_params = sum(p.numel() for p in ddp.parameters())
    train_step(ddp, optimizer, args.vocab, args.seq)
    results: dict[str, float] = {}

    # --- ours --------------------------------------------------------------------------------
    rss_before = rss_bytes()
    manager = OffloadManager([ddp], optimizer, device="cuda")
    train_step(ddp, optimizer, args.vocab, args.seq)  # initialisation is followed by training
    param_bytes = manager._arena_bytes("params")
    optim_bytes = manager._arena_bytes("optimizer")
    results["first_optimizer_offload_gbps"] = optim_bytes / timed(lambda: manager.offload(["optimizer"])) / GB
    manager.onload(["optimizer"])
    allocated_before = torch.cuda.memory_allocated()
    offload_s, onload_s = [], []
    for _ in range(args.repeats):
        offload_s.append(timed(lambda: manager.offload()))
        if not offload_s[1:]:
            allocated_offloaded = torch.cuda.memory_allocated()
        onload_s.append(timed(lambda: manager.onload()))
    moved = param_bytes + optim_bytes
    results["steady_offload_gbps"] = moved / min(offload_s[1:] or offload_s) / GB
    results["steady_onload_gbps"] = moved / min(onload_s[1:] or onload_s) / GB
    results["device_memory_left_after_offload_fraction"] = allocated_offloaded / allocated_before
    results["snapshot_to_host_gbps"] = param_bytes / timed(manager.snapshot_params_to_host) / GB
    results["host_bytes_per_offloaded_byte"] = (rss_bytes() - rss_before) / moved
    results["host_arena_bytes_per_offloaded_byte"] = manager.host_bytes() / moved
    loss_after = train_step(ddp, optimizer, args.vocab, args.seq)
    print("verl-npu:", json.dumps(results), flush=True)
    manager.close()
    gc.collect()

    # --- verl 0.9.1 --------------------------------------------------------------------------
    from verl.utils import megatron_utils as vm

    model_bytes = sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.buffers)
    vm.offload_megatron_model_to_cpu([ddp])
    vm.load_megatron_model_to_gpu([ddp], load_grad=True)  # first call allocates verl's pinned buffers
    results["verl_model_offload_gbps"] = model_bytes / timed(lambda: vm.offload_megatron_model_to_cpu([ddp])) / GB
    results["verl_model_onload_gbps"] = (
        model_bytes / timed(lambda: vm.load_megatron_model_to_gpu([ddp], load_grad=True)) / GB
    )
    results["verl_first_optimizer_offload_gbps"] = (
        optim_bytes / timed(lambda: vm.offload_megatron_optimizer(optimizer)) / GB
    )
    results["verl_optimizer_onload_gbps"] = optim_bytes / timed(lambda: vm.load_megatron_optimizer(optimizer)) / GB
    results["verl_steady_optimizer_offload_gbps"] = (
        optim_bytes / timed(lambda: vm.offload_megatron_optimizer(optimizer)) / GB
    )
    vm.load_megatron_optimizer(optimizer)
    results["verl_copy_model_to_cpu_gbps"] = model_bytes / timed(lambda: vm.copy_megatron_model_to_cpu([ddp])) / GB

    targets = {
        "steady_offload_gbps": (">=", 50.0),
        "steady_onload_gbps": (">=", 50.0),
        "first_optimizer_offload_gbps": (">=", 40.0),
        "snapshot_to_host_gbps": (">=", 40.0),
        "device_memory_left_after_offload_fraction": ("<=", 0.02),
        "host_bytes_per_offloaded_byte": ("<=", 1.1),
    }
    table = Table(title=f"offload, {n_params / 1e6:.0f}M-parameter GPT, {torch.cuda.get_device_name()}")
    for column in ("measure", "value", "target", "met"):
        table.add_column(column)
    for key, value in results.items():
        op, limit = targets.get(key, ("", None))
        met = "" if limit is None else ("yes" if (value >= limit if op == ">=" else value <= limit) else "NO")
        table.add_row(key, f"{value:.3f}", f"{op} {limit}" if limit is not None else "", met)
    Console().print(table)
    doc = {
        "benchmark": "verl-npu OffloadManager vs verl 0.9.1 megatron offload helpers",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "cpu_count": os.cpu_count()},
        "versions": {
            "python": platform.python_version(),
            **{d: importlib.metadata.version(d) for d in ("torch", "megatron-core", "verl")},
        },
        "model": {"parameters": n_params, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "bytes": {"params": param_bytes, "optimizer": optim_bytes},
        "results": results,
        "targets": {k: f"{op} {v}" for k, (op, v) in targets.items()},
        "loss_after_offload_cycles": loss_after,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
