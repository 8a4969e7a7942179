"""Benchmark (issue 33, item 1): IndexShare's top-k carry between two pipeline stages, beside megatron's P2P of
activations, in megatron's own 1F1B schedule, with the P2P timestamps that show the schedule.

Launch with two ranks, one per device:

    torchrun --nproc-per-node 2 bench/index_share_carry.py --out bench/results/index_share_carry_<device>.json

Shape. GLM-5.2's layers 14-19 (full, shared, shared | shared, full, shared: ``glm5_2_indexer_types``) at the
example's per-device attention (TP 2: 32 of the 64 heads, hidden 6144, q_lora_rank 2048, kv_lora_rank 512, the
indexer's 32 heads x 128, top-k 2048), a small dense MLP, batch 1, bf16, split over PP=2 so that the second stage
starts on a shared layer and needs the first stage's last full-layer top-k (layer 14). Sequence lengths 4k and 8k;
``--micro-batches`` per step (default 8). megatron-core 0.18 on the local spec with verl-npu's runtime patches,
the carry through ``dsa-index-share-pipeline-*`` (verl_npu/runtime_patches/dsa_index_share.py).

What is timed, per rank:

- every ``P2PCommunicator._communicate`` of the schedule (the activations forward, the gradients back), and every
  carry send and receive (``_send_topk`` / ``_recv_topk`` of the runtime patch): host start and end (a clock
  shared by both ranks after a barrier) and, on a GPU, CUDA events around the call on the current stream (a
  receive's time includes waiting for the sender: a bubble, not only the transfer);
- each micro-batch's forward start (the schedule as the host runs it) and the whole step;
- alone, outside the schedule: one activation (``_communicate``, megatron's batched P2P) and one carry (the
  patch's own send and receive), ``--repeats`` times after a barrier: the transfer without any bubble.

The summary gives the carry's transfer as a fraction of the activation's and of the step, and the critical-path
cost on the receiving stage: per micro-batch, from the end of the activation's receive to the end of the carry's,
the time its forward waits for the carry.

``--cpu`` runs the same on gloo with a tiny float32 shape (the CPU harness of verl_npu/testing/cpu_megatron.py):
a check that the measurement runs and counts right, not a figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from verl_npu.models.glm5.config import glm5_2_indexer_types

LAYERS = glm5_2_indexer_types(20)[14:20]  # full, shared, shared | shared, full, shared
FULL_SHAPE = dict(
    hidden_size=6144, num_attention_heads=32, intermediate_size=1024, q_lora_rank=2048, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
    index_topk=2048, vocab_size=1024,
)  # fmt: skip
CPU_SHAPE = dict(
    hidden_size=64, num_attention_heads=4, intermediate_size=64, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16,
    index_topk=8, vocab_size=128,
)  # fmt: skip


class Clock:
    """Host milliseconds since a barrier both ranks passed; CUDA events where there is a GPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list[dict[str, Any]] = []
        self._pending: list[tuple[dict[str, Any], Any, Any]] = []
        self.recording = False
        self.t0 = time.perf_counter()

    def reset(self) -> None:
        import torch.distributed as dist

        self.events.clear()
        self._pending.clear()
        dist.barrier()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def timed(self, kind: str, fn, nbytes: int = 0):
        """Wrap ``fn``: each call while recording becomes an event of ``kind``."""

        def run(*args, **kwargs):
            if not self.recording:
                return fn(*args, **kwargs)
            event: dict[str, Any] = {"kind": kind, "bytes": nbytes, "host_start_ms": self.now()}
            begin = end = None
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            out = fn(*args, **kwargs)
            if self.cuda:
                end.record()
            event["host_end_ms"] = self.now()
            self.events.append(event)
            self._pending.append((event, begin, end))
            return out

        return run

    def mark(self, kind: str) -> None:
        if self.recording:
            self.events.append({"kind": kind, "host_start_ms": self.now()})

    def settle(self) -> None:
        """Device times of the calls recorded (after a synchronise)."""
        if self.cuda:
            torch.cuda.synchronize()
        for event, begin, end in self._pending:
            event["device_ms"] = begin.elapsed_time(end) if self.cuda else event["host_end_ms"] - event["host_start_ms"]
        self._pending.clear()


def p2p_kind(kwargs: dict[str, Any]) -> str:
    """What one ``_communicate`` call moves, in the schedule's words."""
    parts = []
    if kwargs.get("tensor_send_next") is not None:
        parts.append("send activation")
    if kwargs.get("recv_prev"):
        parts.append("recv activation")
    if kwargs.get("tensor_send_prev") is not None:
        parts.append("send grad")
    if kwargs.get("recv_next"):
        parts.append("recv grad")
    return " + ".join(parts) or "none"


def instrument(clock: Clock) -> None:
    """Time megatron's P2P and the carry's send and receive, as the schedule calls them."""
    from megatron.core.pipeline_parallel import p2p_communication

    from verl_npu.runtime_patches import dsa_index_share

    communicate = p2p_communication.P2PCommunicator._communicate

    def timed_communicate(self, **kwargs):
        return clock.timed(f"p2p: {p2p_kind(kwargs)}", communicate)(self, **kwargs)

    p2p_communication.P2PCommunicator._communicate = timed_communicate
    # the patch's wrappers look these up in their module at each call
    dsa_index_share._send_topk = clock.timed("carry: send", dsa_index_share._send_topk)
    dsa_index_share._recv_topk = clock.timed("carry: recv", dsa_index_share._recv_topk)


def build(shape: dict[str, Any], seq: int, cpu: bool):
    from megatron.core import parallel_state, tensor_parallel
    from transformers import GlmMoeDsaConfig

    from verl_npu.testing.glm5_model import build_glm5_model

    dtype = torch.float32 if cpu else torch.bfloat16
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf = GlmMoeDsaConfig(
        num_hidden_layers=len(LAYERS), mlp_layer_types=["dense"] * len(LAYERS), max_position_embeddings=seq,
        indexer_types=LAYERS, **shape,
    )  # fmt: skip
    model = build_glm5_model(
        hf, fused_rmsnorm=True, params_dtype=dtype, bf16=not cpu, use_cpu_initialization=cpu,
        pipeline_model_parallel_size=2, pipeline_dtype=dtype,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )  # fmt: skip
    return (model if cpu else model.cuda()), hf


def alone(model, hf, seq: int, repeats: int, clock: Clock, device: torch.device) -> dict[str, Any]:
    """One activation and one carry between the stages, outside the schedule (no bubble): median ms and bytes."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from verl_npu.engine import index_share
    from verl_npu.runtime_patches import dsa_index_share

    communicator = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), model.config)
    first = parallel_state.is_pipeline_first_stage()
    plan = index_share.current_stage()
    dtype = model.config.pipeline_dtype
    shape = (seq, 1, hf.hidden_size)
    activation = torch.randn(shape, dtype=dtype, device=device)
    topk = torch.randint(0, seq, (1, seq, hf.index_topk), dtype=torch.int64, device=device)
    times: dict[str, list[float]] = {"activation": [], "carry": []}
    for _ in range(repeats + 1):  # the first is a warm-up (NCCL's connection between the two ranks)
        for what in ("activation", "carry"):
            dist.barrier()
            if clock.cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            if what == "activation" and first:
                communicator._communicate(tensor_send_next=activation, tensor_send_prev=None, recv_prev=False,
                                          recv_next=False, tensor_shape=shape)  # fmt: skip
            elif what == "activation":
                communicator._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                                          recv_next=False, tensor_shape=shape)  # fmt: skip
            elif first:
                index_share.to_send(topk)
                dsa_index_share._send_topk(communicator, activation, plan)
            else:
                dsa_index_share._recv_topk(communicator, activation)
                index_share.take_received(plan)
            if clock.cuda:
                torch.cuda.synchronize()
            times[what].append((time.perf_counter() - started) * 1e3)
    return {
        "activation_bytes": activation.numel() * activation.element_size(),
        "carry_bytes": topk.numel() * 4 + 3 * 8,  # int32 top-k and the int64 [b, s, k] header
        "activation_ms": statistics.median(times["activation"][1:]),
        "carry_ms": statistics.median(times["carry"][1:]),
    }


def schedule(model, hf, seq: int, micro_batches: int, repeats: int, clock: Clock, device: torch.device):
    """megatron's 1F1B over ``micro_batches``: each repeat's step time, and the events of the last one."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = [torch.randint(0, hf.vocab_size, (1, seq), device=device) for _ in range(micro_batches)]
    positions = torch.arange(seq, device=device).unsqueeze(0)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, net):
        clock.mark("forward")
        batch = next(data_iterator)
        return net(batch, positions, None, labels=batch), loss_func

    run = get_forward_backward_func()
    steps = []
    for repeat in range(repeats + 1):  # the first is a warm-up
        model.zero_grad_buffer() if hasattr(model, "zero_grad_buffer") else model.zero_grad(set_to_none=True)
        clock.reset()
        clock.recording = repeat == repeats
        run(forward_step_func=forward_step, data_iterator=iter(tokens), model=[model], num_microbatches=micro_batches,
            seq_length=seq, micro_batch_size=1)  # fmt: skip
        if clock.cuda:
            torch.cuda.synchronize()
        steps.append(clock.now())
        clock.recording = False
    clock.settle()
    return statistics.median(steps[1:]), list(clock.events)


def summarise(stage_events: list[list[dict[str, Any]]], step_ms: float, alone_row: dict[str, Any]) -> dict[str, Any]:
    """The carry against the activations and the step, from both stages' events."""
    sender, receiver = stage_events
    carry_sends = [e for e in sender if e["kind"] == "carry: send"]
    carry_recvs = [e for e in receiver if e["kind"] == "carry: recv"]
    activation_recvs = [e for e in receiver if e["kind"].startswith("p2p:") and "recv activation" in e["kind"]]
    forwards = [e for e in receiver if e["kind"] == "forward"]
    # the receiving stage's forward of micro-batch i waits, after its activation arrived, for the carry
    waits = [c["host_end_ms"] - a["host_end_ms"] for a, c in zip(activation_recvs, carry_recvs, strict=False)]
    carry_ms = alone_row["carry_ms"]
    return {
        "micro_batches_carried": len(carry_recvs),
        "carry_sends": len(carry_sends),
        "carry_over_activation": carry_ms / alone_row["activation_ms"] if alone_row["activation_ms"] else None,
        "carry_per_step_over_step": carry_ms * len(carry_recvs) / step_ms if step_ms else None,
        "carry_wait_after_activation_ms": waits,
        "carry_wait_per_step_over_step": sum(waits) / step_ms if step_ms else None,
        "sender_host_ms_in_carry_send": [e["host_end_ms"] - e["host_start_ms"] for e in carry_sends],
        "receiver_forwards": len(forwards),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="default: 4096 8192 (--cpu: 64 128)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="gloo and a tiny float32 shape: a check, not a figure")
    args = parser.parse_args()
    if args.micro_batches < 2 or args.repeats < 1:
        parser.error("--micro-batches must be at least 2 (a pipeline) and --repeats at least 1")
    seqs = args.seqs or ([64, 128] if args.cpu else [4096, 8192])

    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
    if world != 2:
        parser.error(f"run under torchrun with two ranks (--nproc-per-node 2); WORLD_SIZE is {world or 'unset'}")
    if not args.cpu and torch.cuda.device_count() < 2:
        parser.error(f"two GPUs are needed, this machine has {torch.cuda.device_count()} (--cpu checks the code)")
    os.environ.setdefault("VERL_NPU_ALLOW_MISMATCH", "1")  # the device's torch differs from the Ascend pin
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        from verl_npu.testing import cpu_megatron

        cpu_megatron.activate()
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    from megatron.core import parallel_state

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches, the carry among them)

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    clock = Clock(cuda=not args.cpu)
    instrument(clock)
    shape = CPU_SHAPE if args.cpu else FULL_SHAPE
    rows = []
    for seq in seqs:
        model, hf = build(shape, seq, args.cpu)
        alone_row = alone(model, hf, seq, args.repeats, clock, device)
        step_ms, events = schedule(model, hf, seq, args.micro_batches, args.repeats, clock, device)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, {"events": events, "step_ms": step_ms, "alone": alone_row})
        if rank == 0:
            step = max(g["step_ms"] for g in gathered)
            rows.append({
                "seq": seq, "step_ms": step, "alone": gathered[1]["alone"],
                "summary": summarise([g["events"] for g in gathered], step, gathered[1]["alone"]),
                "events": {"stage0": gathered[0]["events"], "stage1": gathered[1]["events"]},
            })  # fmt: skip
        del model
        if not args.cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        report(rows, args, shape)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(rows: list[dict[str, Any]], args: argparse.Namespace, shape: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    device = "cpu (gloo, a check, not a figure)" if args.cpu else torch.cuda.get_device_name()
    table = Table(title=f"IndexShare carry, PP=2, {args.micro_batches} micro-batches, top-k {shape['index_topk']}, "
                        f"{device}")  # fmt: skip
    for column in ("seq", "activation MiB / ms", "carry MiB / ms", "carry / activation", "step ms",
                   "carries / step", "carry wait / step"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        a, s = r["alone"], r["summary"]
        table.add_row(
            str(r["seq"]), f"{a['activation_bytes'] / 2**20:.1f} / {a['activation_ms']:.3f}",
            f"{a['carry_bytes'] / 2**20:.1f} / {a['carry_ms']:.3f}", f"{s['carry_over_activation']:.2f}",
            f"{r['step_ms']:.1f}", f"{s['carry_per_step_over_step']:.3f}", f"{s['carry_wait_per_step_over_step']:.3f}",
        )  # fmt: skip
    Console(width=160).print(table)
    versions = {}
    for dist_name in ("torch", "megatron-core", "transformers", "verl-npu"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            versions[dist_name] = "absent"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "bench/index_share_carry.py", "device": device, "devices": 2,
        "backend": "gloo" if args.cpu else "nccl", "date": datetime.date.today().isoformat(), "versions": versions,
        "layers": LAYERS, "stages": [LAYERS[:3], LAYERS[3:]], "shape": shape, "micro_batches": args.micro_batches,
        "repeats": args.repeats, "rows": rows,
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
