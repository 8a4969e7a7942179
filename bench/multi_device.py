"""Engine pieces on several GPUs (issue 8): loss equality with offload cycles, checkpoint, THD, per-rank GB/s.

Run with ``torchrun --nproc-per-node=2 bench/multi_device.py --out results.json``. For each layout
(DP=2 with the distributed optimizer; TP=2 with sequence parallel; EP=2 for the MoE layers) it
trains the tiny GLM-5-shaped model (MLA + DSA + MoE, fused RMSNorm) 5 steps without offload and
5 steps with a full offload/onload cycle between steps, and compares the losses exactly; then both
ranks save a megatron dist-checkpoint while offloaded, a freshly built model and optimizer load it,
and the resumed losses are compared with the original run's. Under TP=2+SP, verl's packing of real
variable-length batches (``preprocess_packed_seqs``) is run through a dense model in THD and
compared with the padded run (DSA itself refuses THD in megatron-core 0.18). Then both ranks move a
large model's state at once and report per-rank GB/s. Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_gpt import build_gpt, train_step

LAYOUTS = {"dp2": dict(tp=1, ep=1, sp=False), "tp2_sp": dict(tp=2, ep=1, sp=True), "ep2": dict(tp=1, ep=2, sp=False)}


def build(seed: int, layout: dict, *, hidden: int = 256, layers: int = 3):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from transformers import GlmMoeDsaConfig

    from verl_npu.testing.glm5_model import build_glm5_model

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    hf = GlmMoeDsaConfig(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=512,
        moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16,
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


CHECKPOINT_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",  # what verl 0.9.1 asks for by default
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def sharded_state(ddp, optimizer, *, loading: bool) -> dict:
    from megatron.core import parallel_state

    model_metadata = dict(CHECKPOINT_METADATA, dp_cp_group=parallel_state.get_data_parallel_group(True))
    model = ddp.module.sharded_state_dict(metadata=model_metadata)
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, loading, metadata=CHECKPOINT_METADATA)}


def shared_directory() -> str:
    """One directory for all ranks (rank 0 creates it): dist-checkpointing writes one file per rank."""
    holder = [tempfile.mkdtemp(prefix="verl_npu_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def checkpoint_round_trip(layout: dict, ddp, optimizer, manager) -> dict:
    """Save while offloaded; a fresh model+optimizer (offloaded too) loads it; resumed losses must match."""
    from megatron.core import dist_checkpointing

    from verl_npu.engine.offload import OffloadManager
    from verl_npu.engine.optimizer_state import ensure_torch_adam_state, resync_torch_adam_steps

    directory = shared_directory()
    manager.offload()
    with manager.resident(["params", "optimizer"]):
        dist_checkpointing.save(sharded_state(ddp, optimizer, loading=False), directory)
    dist.barrier()
    files = sorted(os.listdir(directory))
    manager.onload()
    continued = [step(ddp, optimizer, s) for s in range(5, 8)]
    manager.close()

    fresh_ddp, fresh_optimizer = build(7, layout)  # another seed: every value must come from the file
    fresh = OffloadManager([fresh_ddp], fresh_optimizer, device=torch.device("cuda", torch.cuda.current_device()))
    fresh.offload()
    with fresh.resident(["params", "optimizer"]):
        ensure_torch_adam_state(fresh_optimizer)
        loaded = dist_checkpointing.load(sharded_state(fresh_ddp, fresh_optimizer, loading=True), directory)
        fresh_ddp.module.load_state_dict(loaded["model"])
        fresh_optimizer.load_state_dict(loaded["optimizer"])
        resync_torch_adam_steps(fresh_optimizer)
    fresh.onload()
    resumed = [step(fresh_ddp, fresh_optimizer, s) for s in range(5, 8)]
    fresh.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return {"resume_equal": resumed == continued, "continued_losses": continued, "resumed_losses": resumed,
            "checkpoint_files": files}  # fmt: skip


def run_layout(name: str, layout: dict) -> dict:
    from megatron.core import parallel_state

    from verl_npu.engine.offload import OffloadManager

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
    checkpoint = checkpoint_round_trip(layout, ddp, optimizer, manager)
    shards = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(shards, torch.tensor([shard_bytes], device="cuda"))
    return {
        "layout": name,
        **layout,
        "losses_equal": losses == reference,
        "reference_losses": reference,
        "offload_losses": losses,
        **checkpoint,
        "optimizer_shard_bytes_per_rank": [int(t.item()) for t in shards],
        "min_bytes_freed_per_offload_rank0": min(freed),
    }


def packed_batches(tp: int) -> dict:
    """TP=2+SP on verl's THD path: real packed batches follow the alignment rule and match the padded run.

    verl pads every sequence to a multiple of tp (tp*cp*2 with CP) before packing, so sequence
    parallelism can split the packed token dimension evenly; without that padding the split fails.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.models.mcore.util import postprocess_packed_seqs, preprocess_packed_seqs

    from verl_npu.engine.layer_spec import local_decoder_block_spec
    from verl_npu.engine.offload import OffloadManager

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)

    def build_dense():
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=256,
            num_attention_heads=8,
            num_query_groups=2,
            ffn_hidden_size=512,
            normalization="RMSNorm",
            gated_linear_unit=True,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            masked_softmax_fusion=False,
            tensor_model_parallel_size=tp,
            sequence_parallel=True,
        )  # fmt: skip  (fp32: the THD/BSHD comparison then shows only summation-order differences)
        model = GPTModel(
            config=config, transformer_layer_spec=local_decoder_block_spec(config, fused_rmsnorm=True),
            vocab_size=512, max_sequence_length=128, position_embedding_type="rope",
        ).cuda()  # fmt: skip
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
        adam = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(adam, [ddp])
        return ddp, optimizer

    def real_batch(index: int):
        """Right-padded [4, 96] batch of variable lengths, as verl's rollout hands it over."""
        gen = torch.Generator().manual_seed(index)
        lengths = torch.randint(3, 97, (4,), generator=gen)
        ids = torch.randint(0, 512, (4, 96), generator=gen).cuda()
        mask = (torch.arange(96).unsqueeze(0) < lengths.unsqueeze(1)).cuda()
        return ids, mask

    def thd_loss(ddp, ids, mask):
        packed_ids, params = preprocess_packed_seqs(ids, mask)
        per_token = ddp(packed_ids, None, None, labels=packed_ids, packed_seq_params=params)  # [1, T]
        valid = torch.zeros_like(per_token, dtype=torch.bool)
        for i, start in enumerate(params.cu_seqlens_q_padded[:-1].tolist()):
            valid[0, start : start + int(mask[i].sum())] = True
        return (per_token * valid).sum() / valid.sum()

    def thd_step(ddp, optimizer, index: int) -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = thd_loss(ddp, *real_batch(index))
        loss.backward()
        finalize_model_grads([ddp])
        optimizer.step()
        return loss.item()

    ddp, optimizer = build_dense()
    ids, mask = real_batch(0)
    packed_ids, params = preprocess_packed_seqs(ids, mask)
    padded = (params.cu_seqlens_q_padded[1:] - params.cu_seqlens_q_padded[:-1]).tolist()
    real_lengths = mask.sum(-1).tolist()
    ddp.eval()
    with torch.no_grad():
        thd_logits = ddp(packed_ids, None, None, packed_seq_params=params)
        thd_logits = postprocess_packed_seqs(thd_logits, params, mask, 4, 96)
        bshd_logits = ddp(ids, None, None)  # right padding: causal attention alone leaves valid tokens exact
        max_diff = (thd_logits - bshd_logits)[mask].abs().max()
        dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
        # the same batch packed without the alignment padding: SP cannot split the token dimension
        lengths = mask.sum(-1).to(torch.int32)
        if int(lengths.sum()) % tp == 0:  # make the total indivisible: drop the last sequence's last token
            mask[-1, lengths[-1] - 1] = False
            lengths[-1] -= 1
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        unaligned = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))  # fmt: skip
        try:
            ddp(ids[mask].unsqueeze(0), None, None, packed_seq_params=unaligned)
            unaligned_error = None
        except Exception as exc:
            unaligned_error = f"{type(exc).__name__}: {exc}"[:300]
    ddp.train()
    reference = [thd_step(ddp, optimizer, s) for s in range(1, 5)]
    ddp, optimizer = build_dense()
    manager = OffloadManager([ddp], optimizer, device=torch.device("cuda", torch.cuda.current_device()))
    losses = []
    for s in range(1, 5):
        losses.append(thd_step(ddp, optimizer, s))
        manager.offload()
        manager.onload()
    manager.close()
    return {
        "tp": tp,
        "sequence_parallel": True,
        "real_lengths": real_lengths,
        "padded_lengths": padded,
        "packed_tokens": int(packed_ids.shape[1]),
        "every_sequence_padded_to_tp": all(n % tp == 0 for n in padded),
        "thd_vs_padded_max_abs_logit_diff": max_diff.item(),
        "unaligned_total_tokens": int(unaligned.cu_seqlens_q[-1]),
        "unaligned_packing_error": unaligned_error,
        "thd_losses_equal_with_offload": losses == reference,
        "thd_reference_losses": reference,
        "thd_offload_losses": losses,
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
    parser.add_argument("--skip-thd", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true")
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
            traceback.print_exc()
    if not args.skip_thd:
        try:
            results["thd"] = packed_batches(tp=2)
        except Exception as exc:
            results["errors"]["thd"] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
    if not args.skip_bandwidth:
        try:
            results["bandwidth"] = bandwidth(args.bench_hidden, args.bench_layers, repeats=5)
        except Exception as exc:
            results["errors"]["bandwidth"] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
    if dist.get_rank() == 0:
        from megatron.core import __version__ as mcore

        results["megatron_core"] = mcore
        for row in results["layouts"]:
            print(f"{row['layout']:8s} losses_equal={row['losses_equal']} resume_equal={row['resume_equal']} "
                  f"shards={row['optimizer_shard_bytes_per_rank']}")  # fmt: skip
        if "thd" in results:
            thd = results["thd"]
            print(f"thd tp=2 sp: padded {thd['padded_lengths']} (real {thd['real_lengths']}), "
                  f"max |logit diff| {thd['thd_vs_padded_max_abs_logit_diff']:.2e}, "
                  f"offload equal {thd['thd_losses_equal_with_offload']}, "
                  f"unaligned -> {thd['unaligned_packing_error']}")  # fmt: skip
        for row in results.get("bandwidth", {}).get("per_rank", []):
            print(f"rank {row['rank']}: offload {row['offload_gbps']} GB/s, onload {row['onload_gbps']} GB/s, "
                  f"{row['bytes_moved'] / 1e9:.2f} GB")  # fmt: skip
        print("errors:", json.dumps(results["errors"], indent=1))
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
