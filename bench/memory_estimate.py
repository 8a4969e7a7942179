"""Validate verl_npu.preflight.memory against what megatron-core really allocates, component by component.

On one CUDA GPU (world size 1) this builds small megatron-core GPT models on the local spec (a dense
llama-shaped model of about 300M parameters and a qwen3_moe-shaped MoE with the allgather token
dispatcher), bf16 parameters, DDP with fp32 gradient buffers, the distributed optimizer with fp32
main parameters and Adam, unfused local attention, and measures with torch.cuda.memory_allocated:
  weights     allocated after the model is built,
  grads       allocated by the DDP wrap (gradient buffer),
  optimizer   allocated by the optimizer's construction (fp32 main parameters) plus by its first
              step (exp_avg, exp_avg_sq),
  activations peak during a steady-state forward + backward minus what was resident before it,
              once without recompute and once with full recompute (uniform, 1 layer),
  offload     what verl_npu's OffloadManager leaves on the device after a full offload (vs the
              estimator's offloaded floor) and its host arena bytes (vs the estimated host bytes).
Each is compared with the estimate for the same settings; the script prints a table, writes JSON
(device, versions, date, table) and exits non-zero when any component is off by more than 10%.
Measurements start after a warm-up that allocates cuBLAS's per-thread workspaces (forward and
autograd's backward thread), and each case gets a fresh megatron global memory buffer. A third,
traced forward + backward records where the allocator's peak happens and what is alive there
(``activation_peak_probe`` in the JSON).

Norms: the models use a norm that saves its input and the fp32 inverse RMS for backward, the memory
behaviour of fused norms (torch_npu.npu_rms_norm, TE) that the estimator assumes; megatron's local
``WrappedTorchNorm`` would run torch's composite RMSNorm, which saves fp32 copies of its input.

``--device cpu`` is a dry run of the same code path on the CPU (verl_npu/testing/cpu_megatron.py
redirects megatron's CUDA calls); activations are then counted by a dispatch-mode tracker of live
tensor storages instead of the CUDA allocator.

    python bench/memory_estimate.py --out bench/results/memory_estimate_h200.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.metadata
import json
import sys
import traceback
from pathlib import Path

import torch

from verl_npu.parallelism import Parallelism
from verl_npu.preflight.memory import (
    Activations,
    Offload,
    Precision,
    estimate,
)
from verl_npu.preflight.model_shape import ModelShape

TOLERANCE = 0.10
MODELS = {
    # llama-shaped dense model, about 300M parameters
    "dense": dict(
        model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    # qwen3_moe-shaped MoE: 16 experts, 4 per token, every other layer dense, qk norms
    "moe": dict(
        model_type="qwen3_moe", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=512, decoder_sparse_step=2, mlp_only_layers=[],
    ),
}  # fmt: skip
BATCH = {"dense": dict(micro_batch_size=1, seq_len=2048), "moe": dict(micro_batch_size=2, seq_len=1024)}
TINY = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4, vocab_size=512)


# --- a norm with a fused kernel's memory behaviour ------------------------------------------------
class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x32, g32 = x.float(), grad.float()
        xhat = x32 * rstd
        gw = g32 * weight.float()
        gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), (g32 * xhat).sum(dim=tuple(range(x.dim() - 1))).to(weight.dtype), None


class FusedRMSNorm(torch.nn.Module):
    """megatron's norm constructor signature; saves (input, weight, fp32 rstd) like a fused kernel."""

    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="RMSNorm"):  # fmt: skip
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


# --- model, DDP, optimizer -----------------------------------------------------------------------
def transformer_config(shape: ModelShape, recompute: str | None, cpu: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.router_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size, moe_layer_freq=[int(m) for m in shape.is_moe],
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_grouped_gemm=False,
    ) if shape.num_experts else {}  # fmt: skip
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_layernorm, normalization="RMSNorm",
        params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, use_cpu_initialization=cpu, **moe, **(full if recompute == "full" else {}),
    )  # fmt: skip


def build(shape: ModelShape, recompute: str | None, seq: int, device: str, sizes: dict[str, int]):
    """(ddp, optimizer); records weights / grads / optimizer-construction bytes in ``sizes``."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from verl_npu.engine.layer_spec import swap_norms

    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = transformer_config(shape, recompute, device == "cpu")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        swap_norms(layer, FusedRMSNorm)
    spec.layer_norm = FusedRMSNorm
    before = allocated(device)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=shape.vocab_size, max_sequence_length=seq,
        position_embedding_type="rope", share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )  # fmt: skip
    model = Float16Module(config, model.to(device))
    sizes["weights"] = allocated(device, model.parameters()) - before
    before = allocated(device, model.parameters())
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    sizes["grads"] = allocated(device, ddp_tensors(ddp)) - before
    before = allocated(device, ddp_tensors(ddp))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True,
                        params_dtype=torch.bfloat16),
        [ddp],
    )  # fmt: skip
    sizes["optimizer"] = allocated(device, [*ddp_tensors(ddp), *optimizer_tensors(optimizer)]) - before
    return ddp, optimizer


def ddp_tensors(ddp):
    return [t for b in [*ddp.buffers, *ddp.expert_parallel_buffers] for t in (b.param_data, b.grad_data)]


def optimizer_tensors(optimizer):
    from verl_npu.engine.offload import _optimizer_tensors

    return list(_optimizer_tensors(optimizer))


def allocated(device: str, tensors=()) -> int:
    """Device bytes in use: the CUDA allocator's count; on the CPU, the unique storages of ``tensors``."""
    if device != "cpu":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """CPU stand-in for the CUDA allocator's statistics: bytes of the live storages that ops created."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[object, int]] = {}
        self.current = self.peak = 0

    def prune(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.prune()
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_flatten
        inputs = {t.untyped_storage()._cdata for t in flat((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in flat(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage._cdata in self.live or storage._cdata in inputs:  # a view, or an in-place result
                continue
            self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
            self.created(storage._cdata, func, t)
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak()
        return out

    def created(self, key: int, func, tensor: torch.Tensor) -> None:
        """Hook: a new storage (for tracing tools)."""

    def at_peak(self) -> None:
        """Hook: a new peak (for tracing tools)."""


def forward_backward(ddp, tokens, positions) -> None:
    ddp.zero_grad_buffer()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()


def activations_bytes(ddp, tokens, positions, device: str) -> int:
    """Peak during forward + backward above what was resident before the forward."""
    if device == "cpu":
        with LiveBytes() as live:
            forward_backward(ddp, tokens, positions)
        return live.peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    forward_backward(ddp, tokens, positions)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


class PeakProbe(LiveBytes):
    """Where the CUDA allocator's peak happens: the op, the phase, and the tensors alive then (diagnostics)."""

    def __init__(self):
        super().__init__()
        self.origin: dict[int, tuple] = {}
        self.phase, self.ops, self.top = "forward", 0, 0
        self.before = torch.cuda.memory_allocated()
        self.report: dict = {}

    def created(self, key, func, tensor) -> None:
        self.origin[key] = (self.phase, str(func).removeprefix("aten."), tuple(tensor.shape), str(tensor.dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops += 1
        peak = torch.cuda.max_memory_allocated() - self.before
        if peak > self.top:
            self.top = peak
            live = sorted(((n, self.origin[k]) for k, (ref, n) in self.live.items() if not ref.expired()), reverse=True)
            self.report = {
                "op": str(func),
                "op_index": self.ops,
                "phase": self.phase,
                "peak_bytes": peak,
                "allocated_after_op": torch.cuda.memory_allocated() - self.before,
                "tracked_live_bytes": sum(n for n, _ in live),
                "largest_live": [[n, *origin] for n, origin in live[:14]],
            }
        return out


def probe_peak(ddp, tokens, positions) -> dict:
    """One more forward + backward, traced: where the peak is and what is alive there."""
    ddp.zero_grad_buffer()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with PeakProbe() as probe:
        loss = ddp(tokens, positions, None, labels=tokens).float().mean()
        torch.cuda.synchronize()
        forward_peak = torch.cuda.max_memory_allocated() - before
        forward_ops, probe.phase = probe.ops, "backward"
        loss.backward()
        torch.cuda.synchronize()
    return dict(
        probe.report, forward_peak=forward_peak, total_peak=torch.cuda.max_memory_allocated() - before,
        forward_ops=forward_ops, total_ops=probe.ops,
    )  # fmt: skip


# --- one case: build, measure, estimate ------------------------------------------------------------
def settings(cfg: dict, batch: dict, recompute: str | None, offload: bool):
    """The model shape and the estimator's inputs for one case (world size 1, nothing sharded)."""
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    activations = Activations(**batch, attention_kernel="unfused", num_microbatches=1, **(full if recompute else {}))
    return ModelShape.from_dict(cfg), dict(
        parallelism=Parallelism(world=1),
        precision=Precision(),
        activations=activations,
        offload=Offload(param_offload=offload, optimizer_offload=offload),
        overhead_bytes=0,
    )


def measure_case(cfg: dict, batch: dict, recompute: str | None, device: str, with_offload: bool):
    from megatron.core import parallel_state

    shape, kwargs = settings(cfg, batch, recompute, with_offload)
    # a fresh global memory buffer (unfused attention's workspace), so that this case allocates its own
    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    base = allocated(device)
    sizes: dict[str, int] = {}
    ddp, optimizer = build(shape, recompute, batch["seq_len"], device, sizes)
    b, s = batch["micro_batch_size"], batch["seq_len"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (b, s), generator=gen).to(device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    # step 1: the optimizer's moments appear at its first step
    forward_backward(ddp, tokens, positions)
    ddp.finish_grad_sync()
    before = allocated(device, [*ddp_tensors(ddp), *optimizer_tensors(optimizer)])
    optimizer.step()
    sizes["optimizer"] += allocated(device, [*ddp_tensors(ddp), *optimizer_tensors(optimizer)]) - before
    # step 2: steady-state activations (persistent workspaces already allocated)
    sizes["activations"] = activations_bytes(ddp, tokens, positions, device)
    probe = probe_peak(ddp, tokens, positions) if device != "cpu" else {}
    # host arenas as this device's offload manager allocates them (cudaHostRegister on CUDA, exact on the CPU)
    est = estimate(shape, **kwargs, platform="cuda" if device != "cpu" else "cpu")
    stage = est.stages[0]
    measured = dict(sizes)
    estimated = {k: stage.train[k] for k in ("weights", "grads", "optimizer", "activations")}
    extra = {"activation_peak_probe": probe} if probe else {}
    if with_offload:
        from verl_npu.engine.offload import OffloadManager

        ddp.finish_grad_sync()
        optimizer.step()
        manager = OffloadManager([ddp], optimizer, device=device)
        gc.collect()
        resident = allocated(device, [*ddp_tensors(ddp), *optimizer_tensors(optimizer)]) - base
        manager.offload()
        gc.collect()
        floor = allocated(device, [*ddp_tensors(ddp), *optimizer_tensors(optimizer)]) - base
        extra |= {
            "resident_before_offload": resident,
            "offloaded_floor_measured": floor,
            "offloaded_floor_estimated": sum(stage.floor.values()),
            "host_bytes_measured": manager.host_bytes(),
            "host_bytes_estimated": stage.host_bytes,
        }
        measured["host"] = manager.host_bytes()
        estimated["host"] = stage.host_bytes
        if device != "cpu":  # on the CPU, "device" bytes are only the tensors counted above
            measured["floor"] = floor
            estimated["floor"] = stage.floor_bytes
        manager.onload()
        manager.close()
    del ddp, optimizer
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    return est, measured, estimated, extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU dry run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = args.device
    init(device)

    rows, cases, failed = [], [], []
    for name, cfg in MODELS.items():
        cfg = dict(cfg, **TINY) if args.tiny else cfg
        batch = dict(BATCH[name], seq_len=128) if args.tiny else BATCH[name]
        for recompute in (None, "full"):
            case = f"{name}/{recompute or 'no-recompute'}"
            try:
                est, measured, estimated, extra = measure_case(cfg, batch, recompute, device, recompute is None)
            except Exception:  # report the other cases all the same
                traceback.print_exc()
                failed.append(dict(case=case, error=traceback.format_exc(limit=-3)))
                continue
            for component, value in measured.items():
                if recompute and component != "activations":
                    continue  # the static state does not depend on recompute
                error = (estimated[component] - value) / value if value else 0.0
                rows.append(
                    dict(case=case, component=component, estimate=estimated[component], measured=value, error=error)
                )
            cases.append(dict(case=case, model=cfg, batch=batch, extra=extra, estimate=est.to_dict()))
            print(case, json.dumps(extra), flush=True)

    print_table(rows)
    ok = not failed and all(abs(r["error"]) <= TOLERANCE for r in rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report(device, rows, cases, failed, ok), indent=2) + "\n")
    return 0 if ok else 1


def init(device: str) -> None:
    if device == "cpu":
        from verl_npu.testing import cpu_megatron

        cpu_megatron.activate()
        cpu_megatron.init_model_parallel()
        # the redirect does not reach recomputation inside backward: build the causal mask on the CPU
        import megatron.core.fusions.fused_softmax as fused_softmax

        fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
        return
    from megatron_gpt import init_single_gpu  # bench/ is on sys.path: the script's own folder

    init_single_gpu()
    for dtype in (torch.bfloat16, torch.float32):  # cuBLAS workspaces, one per thread (forward, autograd's backward)
        x = torch.ones(256, 256, device="cuda", dtype=dtype, requires_grad=True)
        (x @ x).sum().backward()
    torch.cuda.synchronize()


def print_table(rows) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        for r in rows:
            print(f"{r['case']:24} {r['component']:12} {r['estimate'] / 2**20:10.1f} {r['measured'] / 2**20:10.1f} "
                  f"{100 * r['error']:+6.1f}%")  # fmt: skip
        return
    table = Table(title="memory estimate vs measured (MiB)")
    for col in ("case", "component", "estimate", "measured", "error"):
        table.add_column(col, justify="left" if col in ("case", "component") else "right")
    for r in rows:
        flag = "" if abs(r["error"]) <= TOLERANCE else " !"
        table.add_row(r["case"], r["component"], f"{r['estimate'] / 2**20:.1f}", f"{r['measured'] / 2**20:.1f}",
                      f"{100 * r['error']:+.1f}%{flag}")  # fmt: skip
    Console().print(table)


def report(device: str, rows, cases, failed, ok: bool) -> dict:
    versions = {p: importlib.metadata.version(p) for p in ("megatron-core",) if _installed(p)}
    return {
        "device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu (dry run: dispatch-mode tracker)",
        "torch": torch.__version__,
        **versions,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tolerance": TOLERANCE,
        "all_within_tolerance": ok,
        "table": rows,
        "failed": failed,
        "cases": cases,
    }


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
