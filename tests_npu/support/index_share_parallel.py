"""One rank of a parallel run of the tiny GLM-5.2 (tests_npu/engine/test_index_share.py's model) on CPU, gloo.

    python index_share_parallel.py RANK WORLD PORT WORKDIR [--tp N] [--ep N] [--sp] [--no-carry | --stale-carry]

WORLD ranks run megatron's own schedule (1F1B, then a forward-only pass, as RL's log-prob step
runs) over the micro-batches in WORKDIR/batches.pt, with tensor parallelism ``--tp`` (and sequence
parallelism with ``--sp``), expert parallelism ``--ep`` and the rest of WORLD as pipeline stages. A
WORLD=1 run writes the model's weights (WORKDIR/weights.pt), which the other layouts load, each rank
its layers, tensor-parallel slices and experts. Each rank writes its losses, forward-only logits'
sums, gradients (named by global layer; tensor- or expert-parallel runs write none) and each
micro-batch's forward-only top-k per DSA layer to WORKDIR/rank<R>-of-<WORLD>.pt.

``--no-carry`` removes the pipeline top-k patches (the test shows the run then fails);
``--stale-carry`` hands each micro-batch after the first the top-k received for the one before (a
top-k that survived into the next micro-batch; the test shows the results then differ). Uses the
CPU harness of verl_npu/testing/cpu_megatron.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verl_npu.testing import cpu_megatron


def _global_name(name: str, offset: int, first_expert: int = 0) -> str:
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + first_expert}.", name)


def _tensor_parallel_slice(name: str, full: torch.Tensor, shape: torch.Size, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a full weight: megatron splits column-parallel weights on dim 0 and row-parallel
    ones on dim 1 in contiguous chunks, except a gated fc1, whose gate and up halves are split each."""
    if full.shape == shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != shape[d]]
    if name.endswith("linear_fc1.weight") and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def _hand_on_the_previous_micro_batchs_top_k(index_share) -> None:
    take_received = index_share.take_received
    previous = []

    def stale(plan):
        current = take_received(plan)
        handed = previous[-1] if previous else current
        previous.append(current)
        return handed

    index_share.take_received = stale


def main(
    rank: int, world: int, port: int, workdir: Path, *, tp: int = 1, ep: int = 1, sp: bool = False,
    carry: bool = True, stale: bool = False,
) -> None:  # fmt: skip
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu_megatron.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from support.index_share_model import HF, SEQ

    import verl_npu.megatron_adaptor  # noqa: F401  (runtime patches)
    from verl_npu.testing.glm5_model import build_glm5_model

    pp = world // tp
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )  # fmt: skip
    from verl_npu.engine import index_share

    if not carry:
        from support.runtime_patching import without

        from verl_npu.runtime_patches import dsa_index_share

        stack = without(*(p for p in dsa_index_share.PATCHES if "pipeline" in p.id))
        stack.__enter__()
    if stale:
        _hand_on_the_previous_micro_batchs_top_k(index_share)
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = build_glm5_model(
        HF, fused_rmsnorm=True, use_cpu_initialization=True, params_dtype=torch.float32,
        moe_token_dispatcher_type="allgather", pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )  # fmt: skip
    offset = get_transformer_layer_offset(model.config)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    first_expert = ep_rank * (HF.n_routed_experts // ep)
    weights = workdir / "weights.pt"
    if world == 1:
        torch.save(model.state_dict(), weights)
    else:
        full = torch.load(weights)
        model.load_state_dict(
            {
                name: _tensor_parallel_slice(
                    name, full[_global_name(name, offset, first_expert)], local.shape, tp_rank, tp
                )
                if isinstance(local, torch.Tensor)
                else local  # extra state (None)
                for name, local in model.state_dict().items()
            }
        )
    batches = torch.load(workdir / "batches.pt")
    positions = torch.arange(SEQ).unsqueeze(0).expand(batches[0].shape[0], -1)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, net):
        tokens = next(data_iterator)
        return net(tokens, positions, None, labels=tokens), loss_func

    traces = []

    def logits_sum(output):
        total = output.float().sum().detach()  # this rank's vocabulary slice of the logits
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        return output.float().sum(), {"logits_sum": total}

    def logits_step(data_iterator, net):
        tokens = next(data_iterator)
        with index_share.record_topk() as trace:
            output = net(tokens, positions, None)
        traces.append(trace)
        return output, logits_sum

    run = get_forward_backward_func()
    common = dict(num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=batches[0].shape[0])
    losses = run(forward_step_func=forward_step, data_iterator=iter(batches), model=[model], **common)
    grads = {}
    if tp == ep == 1:
        grads = {_global_name(n, offset): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        logits = run(
            forward_step_func=logits_step, data_iterator=iter(batches), model=[model], forward_only=True, **common
        )
    torch.save(
        {"losses": [float(x["loss"]) for x in losses], "logits": [float(x["logits_sum"]) for x in logits],
         "grads": grads, "topk": traces},
        workdir / f"rank{rank}-of-{world}.pt",
    )  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _flags(parser) -> None:
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--no-carry", dest="carry", action="store_false")
    parser.add_argument("--stale-carry", dest="stale", action="store_true")


if __name__ == "__main__":
    from support.gloo_ranks import rank_entry

    rank_entry(
        lambda a: main(a.rank, a.world, a.port, a.workdir, tp=a.tp, ep=a.ep, sp=a.sp, carry=a.carry, stale=a.stale),
        _flags,
    )
