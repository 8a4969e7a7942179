"""Engine pieces on several GPUs (issue 8): loss equality with offload cycles, checkpoint, per-rank GB/s.

Run with ``torchrun --nproc-per-node=2 bench/multi_device.py --out results.json``. For each layout
(DP=2 with the distributed optimizer; TP=2 with sequence parallel; EP=2 for the MoE layers) it
trains the tiny GLM-5-shaped model (MLA + DSA + MoE, fused RMSNorm) 5 steps without offload and
5 steps with a full offload/onload cycle between steps, and compares the losses exactly; then it
saves while offloaded (through ``resident``), restores and resumes; then both ranks move a large
model's state at once and report per-rank GB/s. Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatron_gpt import build_gpt, train_step

LAYOUTS = {"dp2": dict(tp=1, ep=1, sp=False), "tp2_sp": dict(tp=2, ep=1, sp=True), "ep2": dict(tp=1, ep=2, sp=False)}


def build(seed: int, layout: dict, *, hidden: int = 256, layers: int = 3):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from transformers import GlmMoeDsaConfig

    from verl_npu.engine.glm5_model import build_glm5_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    hf = GlmMoeDsaConfig(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=512,
        moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=16, max_position_embeddings=128,
    )  # fmt: skip
    model = build_glm5_model(
        hf, fused_rmsnorm=True, params_dtype=torch.bfloat16, bf16=True,
        tensor_model_parallel_size=layout["tp"], sequence_parallel=layout["sp"],
        expert_model_parallel_size=layout["ep"],
    )  # fmt: skip
    model = Float16Module(model.config, model.cuda())
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True,
                        params_dtype=torch.bfloat16),
        [ddp],
    )  # fmt: skip
    return ddp, optimizer


def step(ddp, optimizer, index: int) -> float:
    from megatron.core import parallel_state

    # every data-parallel rank gets its own batch; tensor-parallel ranks share one
    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1000 * index + dp_rank)
    tokens = torch.randint(0, 256, (2, 64), generator=gen).cuda()
    positions = torch.arange(64, device="cuda").unsqueeze(0).expand(2, -1)
    loss = train_step(ddp, optimizer, tokens, positions)
    reduced = loss.clone()
    dist.all_reduce(reduced)
    return reduced.item() / dist.get_world_size()


def run_layout(name: str, layout: dict) -> dict:
    from megatron.core import parallel_state

    from verl_npu.engine.offload import OffloadManager, _optimizers

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout["tp"], expert_model_parallel_size=layout["ep"]
    )
    ddp, optimizer = build(3, layout)
    reference = [step(ddp, optimizer, s) for s in range(5)]
    del ddp, optimizer
    torch.cuda.empty_cache()
    ddp, optimizer = build(3, layout)
    manager = OffloadManager([ddp], optimizer, device=torch.device("cuda", torch.cuda.current_device()))
    losses, freed = [], []
    shard_bytes = sum(s.nbytes for s in manager._layout("optimizer"))
    for s in range(5):
        losses.append(step(ddp, optimizer, s))
        before = torch.cuda.memory_allocated()
        manager.offload()
        freed.append(before - torch.cuda.memory_allocated())
        manager.onload()
    # checkpoint while offloaded: snapshot through resident(), train on, restore, resume
    manager.offload()
    with manager.resident(["params", "optimizer"]):
        params = [p.detach().clone() for p in ddp.parameters()]
        mains = [p for inner in _optimizers(optimizer) for g in inner.param_groups for p in g["params"]]
        saved_main = [p.detach().clone() for p in mains]
        states = [st for inner in _optimizers(optimizer) for st in inner.state.values()]
        saved_states = [{k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)} for st in states]
    manager.onload()
    resumed_a = [step(ddp, optimizer, s) for s in range(5, 8)]
    for p, saved in zip(ddp.parameters(), params, strict=True):
        p.data.copy_(saved)
    for p, saved in zip(mains, saved_main, strict=True):
        p.data.copy_(saved)
    for st, saved in zip(states, saved_states, strict=True):
        for k, v in saved.items():
            st[k].copy_(v)
    resumed_b = [step(ddp, optimizer, s) for s in range(5, 8)]
    manager.close()
    shards = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(shards, torch.tensor([shard_bytes], device="cuda"))
    return {
        "layout": name,
        **layout,
        "losses_equal": losses == reference,
        "reference_losses": reference,
        "offload_losses": losses,
        "resume_equal": resumed_a == resumed_b,
        "optimizer_shard_bytes_per_rank": [int(t.item()) for t in shards],
        "min_bytes_freed_per_offload_rank0": min(freed),
    }


def bandwidth(hidden: int, layers: int, repeats: int) -> dict:
    """Both ranks offload/onload a large model's full state at once; per-rank GB/s."""
    from megatron.core import parallel_state

    from verl_npu.engine.offload import OffloadManager

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()  # DP=2: each rank holds its optimizer shard
    ddp, optimizer = build_gpt(hidden, layers, vocab=32000, seq=512)
    tokens = torch.randint(0, 32000, (1, 128), device="cuda")
    train_step(ddp, optimizer, tokens, torch.arange(128, device="cuda").unsqueeze(0))
    manager = OffloadManager([ddp], optimizer, device=torch.device("cuda", torch.cuda.current_device()))
    kinds = ["params", "optimizer"]
    nbytes = sum(s.nbytes for k in kinds for s in manager._layout(k))
    manager.offload(kinds)  # first offload (arenas allocated in the background)
    manager.onload(kinds)
    torch.cuda.synchronize()
    off, on = [], []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        manager.offload(kinds)
        torch.cuda.synchronize()
        off.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        manager.onload(kinds)
        torch.cuda.synchronize()
        on.append(time.perf_counter() - t)
    manager.close()
    parameters = sum(p.numel() for p in ddp.parameters())
    mine = torch.tensor([nbytes / min(off) / 1e9, nbytes / min(on) / 1e9, nbytes], device="cuda", dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return {
        "parameters": parameters,
        "per_rank": [
            {
                "rank": r,
                "bytes_moved": int(v[2]),
                "offload_gbps": round(v[0].item(), 1),
                "onload_gbps": round(v[1].item(), 1),
            }
            for r, v in enumerate(everyone)
        ],
        "note": "both ranks copy at the same moment (barrier before each transition); best of repeats",
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="multi_device.json")
    parser.add_argument("--layouts", default="dp2,tp2_sp,ep2")
    parser.add_argument("--bench-hidden", type=int, default=2048)
    parser.add_argument("--bench-layers", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")
    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches: DSA local spec, Hadamard, CPU init)

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    results = {"device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
               "torch": torch.__version__, "layouts": [], "errors": {}}  # fmt: skip
    for name in args.layouts.split(","):
        try:
            results["layouts"].append(run_layout(name, LAYOUTS[name]))
        except Exception as exc:  # record and go on: one layout's failure must not hide the others
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
    try:
        results["bandwidth"] = bandwidth(args.bench_hidden, args.bench_layers, repeats=5)
    except Exception as exc:
        results["errors"]["bandwidth"] = f"{type(exc).__name__}: {exc}"[:2000]
    if dist.get_rank() == 0:
        from megatron.core import __version__ as mcore

        results["megatron_core"] = mcore
        for row in results["layouts"]:
            print(f"{row['layout']:8s} losses_equal={row['losses_equal']} resume_equal={row['resume_equal']} "
                  f"shards={row['optimizer_shard_bytes_per_rank']}")  # fmt: skip
        for row in results.get("bandwidth", {}).get("per_rank", []):
            print(f"rank {row['rank']}: offload {row['offload_gbps']} GB/s, onload {row['onload_gbps']} GB/s, "
                  f"{row['bytes_moved'] / 1e9:.2f} GB")  # fmt: skip
        print("errors:", json.dumps(results["errors"], indent=1))
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
